"""The worker processes of tensor parallelism: ranks 1..N-1, spawned by rank 0 (the engine
process), with a pipe each for the steps and one back for start-up's answer::

    rank 0 ── step pipe (one pickled message, the same bytes to every rank) ──► rank r
    rank 0 ◄── ready pipe ("ready", or ("error", text) when start-up failed) ── rank r

A monitor thread waits on the workers' process sentinels: a rank that exits while the engine
runs is a failure, named with its exit code (and its start-up error, if it sent one). Each
worker watches its parent and exits when orphaned, so no rank outlives the engine.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

logger = logging.getLogger(__name__)

_INTERRUPT = signal.SIGUSR1


class WorkerFailure(RuntimeError):
    """A tensor-parallel rank died, hung, or failed to start."""


class WorkerGroup:
    """Spawns ``target(rank, steps, ready, parent_pid, *args)`` for ranks 1..world-1."""

    def __init__(self, target: Callable[..., None], world: int, args: tuple[Any, ...]) -> None:
        ctx = mp.get_context("spawn")
        self.procs: dict[int, Any] = {}
        self.steps: dict[int, Connection] = {}
        self.ready: dict[int, Connection] = {}
        self.errors: dict[int, str] = {}
        self.failed: str | None = None
        self._closing = False
        self._main_thread = threading.main_thread().ident
        self._interrupt = False
        for rank in range(1, world):
            step_r, step_w = ctx.Pipe(duplex=False)
            ready_r, ready_w = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=target,
                args=(rank, step_r, ready_w, os.getpid(), *args),
                name=f"fulcrum-tp-rank{rank}",
                daemon=True,
            )
            p.start()
            step_r.close()
            ready_w.close()
            self.procs[rank], self.steps[rank], self.ready[rank] = p, step_w, ready_r
        atexit.register(self.shutdown)
        threading.Thread(target=self._monitor, name="fulcrum-tp-monitor", daemon=True).start()

    # -- failures -------------------------------------------------------------------------------

    def describe(self, rank: int) -> str:
        p = self.procs[rank]
        self._read_errors(rank)
        what = f"tensor-parallel rank {rank} (pid {p.pid})"
        if p.exitcode is None:
            what += " is alive but did not answer"
        elif p.exitcode < 0:
            what += f" was killed by signal {signal.Signals(-p.exitcode).name}"
        else:
            what += f" exited with code {p.exitcode}"
        return what + (f": {self.errors[rank]}" if rank in self.errors else "")

    def _read_errors(self, rank: int) -> None:
        conn = self.ready[rank]
        try:
            while conn.poll():
                msg = conn.recv()
                if isinstance(msg, tuple) and msg[0] == "error":
                    self.errors[rank] = msg[1]
        except (EOFError, OSError):
            pass

    def dead_rank(self) -> int | None:
        return next((r for r, p in self.procs.items() if p.exitcode is not None), None)

    def failure(self, cause: BaseException | None = None, grace_s: float = 2.0) -> WorkerFailure:
        """The error to raise for a failed collective or send: the dead rank named where one
        died (waiting up to ``grace_s`` for its exit to show), else the collective's error."""
        deadline = time.monotonic() + grace_s
        while (rank := self.dead_rank()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if rank is not None:
            return WorkerFailure(self.describe(rank))
        return WorkerFailure(f"a tensor-parallel collective failed (a rank hung?): {cause}")

    def _monitor(self) -> None:
        sentinels = {p.sentinel: r for r, p in self.procs.items()}
        ready = wait(list(sentinels))
        if self._closing:
            return
        rank = sentinels[ready[0]]
        self.procs[rank].join(1.0)
        self.failed = self.describe(rank)
        logger.error("%s", self.failed)
        if self._interrupt and not self._closing:
            signal.pthread_kill(self._main_thread, _INTERRUPT)  # type: ignore[arg-type]

    def interrupt_main_on_failure(self) -> None:
        """A rank's death raises ``WorkerFailure`` in the main thread (at its next bytecode:
        an idle engine loop wakes within its poll interval) instead of waiting for the next
        step's collective. Only in a spawned engine process (the server's engine core), from
        its main thread (signal handlers live there): in a user's own process (``LLM``) the
        failure is raised by the next step instead, not inside unrelated code."""
        if threading.current_thread() is not threading.main_thread():
            return
        if mp.current_process().name == "MainProcess":
            return

        def handler(signum: int, frame: Any) -> None:
            if self.failed is not None and not self._closing:
                raise WorkerFailure(self.failed)

        signal.signal(_INTERRUPT, handler)
        self._interrupt = True

    # -- start-up and steps --------------------------------------------------------------------

    def wait_ready(self, timeout_s: float) -> None:
        """Every rank's start-up answer; raise ``WorkerFailure`` naming the first that failed,
        died or did not answer within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        for rank, conn in self.ready.items():
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WorkerFailure(
                        f"tensor-parallel rank {rank} did not finish starting within "
                        f"{timeout_s:g} s (worker_timeout)."
                    )
                got = wait([conn, self.procs[rank].sentinel], timeout=left)
                if conn in got:
                    try:
                        msg = conn.recv()
                    except (EOFError, OSError):
                        raise WorkerFailure(self.failure().args[0]) from None
                    if msg == "ready":
                        break
                    self.errors[rank] = msg[1]
                    raise WorkerFailure(self.describe(rank))
                if got:
                    self.procs[rank].join(1.0)
                    raise WorkerFailure(self.describe(rank))

    def wait_for(self, fn: Callable[[], None], timeout_s: float, what: str) -> None:
        """Run ``fn`` (a blocking rendezvous) in a thread; fail as soon as a rank dies."""
        err: list[BaseException] = []
        t = threading.Thread(target=lambda: _catch(fn, err), daemon=True)
        t.start()
        deadline = time.monotonic() + timeout_s + 5.0
        while t.is_alive():
            t.join(0.1)
            if (rank := self.dead_rank()) is not None:
                raise WorkerFailure(f"{what}: {self.describe(rank)}")
            if time.monotonic() > deadline:
                raise WorkerFailure(f"{what}: timed out after {timeout_s:g} s (worker_timeout).")
        if err:
            raise WorkerFailure(f"{what}: {err[0]}") from err[0]

    def send(self, msg: Any) -> None:
        """One message to every rank, pickled once (the step pipes are private to the engine's
        own processes)."""
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.steps.values():
            try:
                conn.send_bytes(data)
            except OSError as e:  # BrokenPipeError: the rank is gone
                raise self.failure(e) from None

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop every rank: end of the step pipes (a worker exits at EOF), then terminate and
        kill whatever is left; nothing outlives this call."""
        if self._closing:
            return
        self._closing = True
        for conn in self.steps.values():
            try:
                conn.close()
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs.values():
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        atexit.unregister(self.shutdown)


def _catch(fn: Callable[[], None], err: list[BaseException]) -> None:
    try:
        fn()
    except BaseException as e:  # handed to the waiting thread
        err.append(e)


def watch_parent(parent_pid: int) -> None:
    """A worker's thread: exit at once when the engine process is gone."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(1)
