"""The process group of tensor parallelism: this process's rank, the world size, collectives.

One group per engine. The device collectives (all-reduce of the row-parallel outputs,
all-gather of the LM head's vocabulary shards, the broadcast of the sampled ids) run on the
default group: NCCL on CUDA, gloo on the CPU. With one rank (the default state, never
initialized) every helper is the identity and nothing here touches ``torch.distributed``.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

_RANK = 0
_WORLD = 1
# ``all_gather_into_tensor`` under its newer name where torch has it
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def tp_rank() -> int:
    return _RANK


def tp_size() -> int:
    return _WORLD


def init_tensor_parallel(
    rank: int, world: int, backend: str, init_method: str, timeout_s: float
) -> None:
    """Join the group (every rank calls it; it returns once all have joined or raises after
    ``timeout_s``). NVLink multicast stays as the machine sets it (``NCCL_NVLS_ENABLE``)."""
    global _RANK, _WORLD
    kwargs = {}
    if backend == "nccl":
        kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
        **kwargs,
    )
    _RANK, _WORLD = rank, world


def destroy_tensor_parallel() -> None:
    global _RANK, _WORLD
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a peer already gone: nothing left to tear down cleanly
            pass
    _RANK, _WORLD = 0, 1


def abort_tensor_parallel() -> None:
    """Make collectives blocked on a dead peer return with an error (best effort: NCCL's
    communicators abort; gloo already fails on a closed connection)."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None and dist.is_initialized():
        try:
            abort()
        except Exception:
            pass


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks, in place (the row-parallel layers' partial products)."""
    if _WORLD > 1:
        dist.all_reduce(x)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """``x`` of every rank concatenated along the last dimension, in rank order."""
    if _WORLD == 1:
        return x
    x = x.contiguous()
    out = torch.empty((_WORLD * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _gather_into(out, x)  # [rank 0's rows; rank 1's rows; ...]
    out = out.view(_WORLD, *x.shape).movedim(0, -2)  # [..., rank, shard]
    return out.reshape(*x.shape[:-1], _WORLD * x.shape[-1])


def broadcast(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``x`` on every rank, in place."""
    if _WORLD > 1:
        dist.broadcast(x, src=0)
    return x


def all_min(value: int) -> int:
    """The smallest ``value`` over the ranks (the KV pool every rank can hold)."""
    if _WORLD == 1:
        return value
    dev = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([value], dtype=torch.int64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def local_device(rank: int, device: torch.device) -> torch.device:
    """Rank ``rank``'s device: ``cuda:<first + rank>`` on CUDA, the CPU otherwise."""
    if device.type != "cuda":
        return device
    first = device.index if device.index is not None else 0
    return torch.device("cuda", first + rank)


__all__ = [
    "abort_tensor_parallel",
    "all_gather_last",
    "all_min",
    "all_reduce",
    "broadcast",
    "destroy_tensor_parallel",
    "free_port",
    "init_tensor_parallel",
    "local_device",
    "tp_rank",
    "tp_size",
]
