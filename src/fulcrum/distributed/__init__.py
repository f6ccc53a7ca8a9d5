"""Tensor parallelism: process groups (``parallel_state``), sharded layers (``layers``), weight
sharding at load time (``sharding``), start-up checks (``validate``) and the worker processes
(``worker_group``). With ``tensor_parallel_size == 1`` none of it is imported."""
