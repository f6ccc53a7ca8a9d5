"""Tensor parallelism over ModelRunners: one per rank, each with its shard of the weights and
of the KV cache, fed the same steps::

    engine process (rank 0)                         worker process (rank r)
    DriverRunner.execute_async(out)  ── "execute", out ──►  WorkerRunner.execute_async(out)
      forward: all-reduces, LM-head all-gather  ◄══ collectives ══►  the same, in step
      sample on rank 0, broadcast the ids  ═══════════════════════►  receive them (patches, tokens)
    DriverRunner.collect(handle)     ── "collect" ──────────►  collect the oldest step
    DriverRunner.update_states(out)  ── "update", out ──────►  the same
    DriverRunner.load_lora(slot, …)  ── "lora", args ───────►  the same (after rank 0 checked it)

Workers replay exactly the driver's calls, in its order, so they overlap steps when it does
(asynchronous scheduling) and their host-side request states match its own. Only rank 0
samples: the others receive its ids, so a sampled (not greedy) token is the same everywhere.
A failed collective or a dead rank raises ``WorkerFailure`` naming the rank.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch

from fulcrum.config import EngineConfig
from fulcrum.distributed import parallel_state as ps
from fulcrum.distributed.worker_group import WorkerFailure, WorkerGroup, watch_parent
from fulcrum.scheduler.output import SchedulerOutput
from fulcrum.worker.input_batch import ReqState
from fulcrum.worker.model_runner import ModelRunner
from fulcrum.worker.startup import prepare_runner
from fulcrum.worker.step_sampling import StepHandle

logger = logging.getLogger(__name__)


class DriverRunner(ModelRunner):
    """Rank 0: a ModelRunner that sends each call to the workers first and shares what it
    samples."""

    def __init__(self, config: EngineConfig, group: WorkerGroup) -> None:
        self.group = group
        super().__init__(config)

    def _guard(self, fn: Callable, *args):
        try:
            return fn(*args)
        except WorkerFailure:
            raise
        except RuntimeError as e:  # a collective that failed: name the rank behind it
            raise self.group.failure(e) from e

    def execute_async(
        self, out: SchedulerOutput, before_sample: Callable[[], None] | None = None
    ) -> StepHandle:
        self.group.send(("execute", out))
        return self._guard(super().execute_async, out, before_sample)

    def collect(self, h: StepHandle):
        self.group.send(("collect", None))
        return self._guard(super().collect, h)

    def update_states(self, out: SchedulerOutput) -> None:
        self.group.send(("update", out))
        super().update_states(out)

    def load_lora(self, slot: int, name: str, path: str) -> None:
        # here first: a bad adapter fails on rank 0 before any worker writes its slot
        super().load_lora(slot, name, path)
        self.group.send(("lora", (slot, name, path)))

    def _sample(
        self, logits, states, positions, greedy=None, bitmask=None, graph_sampled=False
    ) -> StepHandle:
        handle = super()._sample(logits, states, positions, greedy, bitmask, graph_sampled)
        if self._prev_sampled is not None:
            if self._prev_sampled.dtype != torch.int64:
                self._prev_sampled = self._prev_sampled.to(torch.int64)
            ps.broadcast(self._prev_sampled)
        return handle

    def shutdown(self) -> None:
        self.group.shutdown()
        ps.destroy_tensor_parallel()


class WorkerRunner(ModelRunner):
    """Ranks 1..N-1: the same steps, its ids from rank 0 instead of a sampler."""

    def _graph_params(self, states, positions):
        """None: the ids come from rank 0, so this rank's graphs keep the argmax alone."""
        return None

    def _sample(
        self, logits, states: list[ReqState], positions, greedy=None, bitmask=None, graph_sampled=False
    ):
        self._prev_rows = {st.req_id: i for i, st in enumerate(states)}
        if logits is None:  # prefill chunks only: rank 0 sampled nothing either
            self._prev_sampled = None
            return StepHandle(torch.empty(0, dtype=torch.int64), None, [])
        ids = torch.empty(len(states), dtype=torch.int64, device=self.device)
        self._prev_sampled = ps.broadcast(ids)
        host, event = self.sampling.to_host(ids)
        return StepHandle(host[0], event, states)


def _rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    device = ps.local_device(rank, config.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return dataclasses.replace(config, device=device)


def _prepare(runner: ModelRunner) -> int:
    """The KV pool every rank can hold (the smallest of their profiles), then the graphs."""
    return prepare_runner(runner, agree=ps.all_min)


def start_driver(config: EngineConfig) -> tuple[DriverRunner, int]:
    """Spawn ranks 1..N-1, join the group, load rank 0's shard and size the KV pool with the
    others; ``(runner, num_blocks)``. Raises ``WorkerFailure`` naming a rank that fails."""
    pc = config.parallel_config
    world, timeout = pc.tensor_parallel_size, pc.worker_timeout
    config = _rank_config(config, 0)
    init = f"tcp://127.0.0.1:{ps.free_port()}"
    group = WorkerGroup(worker_main, world, (world, config, init))
    try:
        backend = pc.backend(config.device)
        group.wait_for(
            lambda: ps.init_tensor_parallel(0, world, backend, init, timeout),
            timeout,
            "tensor-parallel start-up",
        )
        runner = DriverRunner(config, group)
        num_blocks = runner._guard(_prepare, runner)
        group.wait_ready(timeout)
    except BaseException:
        group.shutdown()
        ps.destroy_tensor_parallel()
        raise
    group.interrupt_main_on_failure()
    logger.info("Tensor parallelism: %d ranks (%s), %d KV blocks each.", world, backend, num_blocks)
    return runner, num_blocks


def worker_main(
    rank: int,
    steps: Connection,
    ready: Connection,
    parent_pid: int,
    world: int,
    config: EngineConfig,
    init_method: str,
) -> None:
    """A worker process: join, load this rank's shard, then replay the driver's calls until
    its pipe closes."""
    import os
    import pickle

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the server
    threading.Thread(target=watch_parent, args=(parent_pid,), daemon=True).start()
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s tp{rank} %(message)s")
    pc = config.parallel_config
    try:
        config = _rank_config(config, rank)
        ps.init_tensor_parallel(
            rank, world, pc.backend(config.device), init_method, pc.worker_timeout
        )
        runner = WorkerRunner(config)
        _prepare(runner)
        ready.send("ready")
    except BaseException as e:
        logger.exception("start-up failed")
        ready.send(("error", f"{type(e).__name__}: {e}"))
        os._exit(1)
    pending: deque[StepHandle] = deque()
    try:
        while True:
            try:
                kind, out = pickle.loads(steps.recv_bytes())
            except EOFError:  # the driver shut down
                break
            if kind == "execute":
                pending.append(runner.execute_async(out))
            elif kind == "collect":
                runner.collect(pending.popleft())
            elif kind == "lora":
                runner.load_lora(*out)
            else:
                runner.update_states(out)
    except BaseException as e:
        logger.exception("step failed")
        ready.send(("error", f"{type(e).__name__}: {e}"))  # the driver names it
        os._exit(1)
    ps.destroy_tensor_parallel()
    os._exit(0)
