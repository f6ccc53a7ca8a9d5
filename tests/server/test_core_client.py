"""The engine-core process boundary with a fake core: ZMQ + msgpack, aborts, crashes, exits."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest
from fake_core import make_crashing_core, make_fake_core

from fulcrum.engine.async_engine import AsyncEngine, EngineDeadError
from fulcrum.engine.core_client import CoreClient
from fulcrum.engine.core_messages import CoreDead, CoreUnreachableError, RequestError
from fulcrum.engine.output_processor import OutputProcessor
from fulcrum.protocol import EngineCoreOutputs, EngineCoreRequest, WireSamplingParams
from fulcrum.sampling_params import SamplingParams


def _req(rid: str, max_tokens: int, prompt: list[int] | None = None) -> EngineCoreRequest:
    return EngineCoreRequest(
        rid, [1, 2, 3] if prompt is None else prompt, WireSamplingParams(max_tokens=max_tokens)
    )


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_client_roundtrip_errors_and_abort() -> None:
    async def main() -> None:
        client = CoreClient(make_fake_core)
        client.start()
        try:
            ready = await client.wait_ready(60)
            assert ready.pid == client.pid != os.getpid()
            assert ready.max_model_len == 64 and ready.num_blocks_total == 8
            client.add_request(_req("a", 3))
            client.add_request(_req("bad", 3, prompt=[]))
            client.add_request(_req("long", 1000))
            tokens: dict[str, list[int]] = {"a": [], "long": []}
            finish: dict[str, str] = {}
            errors = []
            while "a" not in finish or not errors:
                msg = await client.get_output()
                if isinstance(msg, RequestError):
                    errors.append(msg)
                    continue
                assert isinstance(msg, EngineCoreOutputs)
                for o in msg.outputs:
                    tokens[o.request_id] += o.new_token_ids
                    if o.finish_reason:
                        finish[o.request_id] = o.finish_reason
            assert tokens["a"] == [101, 102, 103] and finish["a"] == "length"
            assert errors[0].request_id == "bad" and "empty" in errors[0].message
            client.abort_requests(["long"])
            while True:  # the abort frees the block; the idle core pushes fresh stats
                msg = await client.get_output()
                assert isinstance(msg, EngineCoreOutputs)
                if msg.stats and msg.stats.num_blocks_free == 8 and msg.stats.num_running == 0:
                    break
        finally:
            client.shutdown()
        assert not client.is_alive()

    asyncio.run(main())


def test_async_engine_streams_and_aborts_on_early_exit() -> None:
    async def main() -> None:
        engine = await AsyncEngine.start(
            make_fake_core, OutputProcessor, tokenizer=None, max_model_len=64, vocab_size=1000
        )
        try:
            outs = [o async for o in engine.generate("r1", [1, 2], SamplingParams(max_tokens=4))]
            assert [o.outputs[0].token_ids for o in outs] == [[101], [102], [103], [104]]
            assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
            assert outs[-1].metrics is not None and outs[-1].metrics.first_token_time
            # Leaving a stream early aborts it in the core: its block is free again.
            gen = engine.generate("r2", [1], SamplingParams(max_tokens=50))
            async for _ in gen:
                break
            await gen.aclose()
            assert engine.num_in_flight == 0
            for _ in range(100):
                engine.request_stats()
                await asyncio.sleep(0.05)
                if engine.stats.num_blocks_free == 8 and engine.stats.num_running == 0:
                    break
            assert engine.stats.num_blocks_free == 8
            with pytest.raises(ValueError, match="empty"):
                async for _ in engine.generate("r3", [], SamplingParams(max_tokens=2)):
                    pass
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_core_crash_fails_requests_not_the_server() -> None:
    async def main() -> None:
        engine = await AsyncEngine.start(
            make_crashing_core, OutputProcessor, tokenizer=None, max_model_len=64, vocab_size=1000
        )
        try:
            with pytest.raises(EngineDeadError, match="simulated crash"):
                async for _ in engine.generate("r", [1], SamplingParams(max_tokens=10)):
                    pass
            assert engine.dead is not None
            with pytest.raises(EngineDeadError):
                async for _ in engine.generate("r2", [1], SamplingParams(max_tokens=1)):
                    pass
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_core_dead_when_process_killed() -> None:
    async def main() -> None:
        client = CoreClient(make_fake_core)
        client.start()
        try:
            await client.wait_ready(60)
            assert client.pid is not None
            os.kill(client.pid, 9)
            msg = await asyncio.wait_for(client.get_output(), 10)
            assert isinstance(msg, CoreDead)
            # Sending to a dead core fails at once instead of blocking the event loop.
            with pytest.raises(CoreUnreachableError):
                for _ in range(100):
                    client.add_request(_req("late", 2))
                    await asyncio.sleep(0.05)
            client.abort_requests(["late"])  # best effort: never raises
        finally:
            client.shutdown()

    asyncio.run(main())


_ORPHAN_SCRIPT = """
import asyncio, os, sys
sys.path[:0] = {paths!r}
from fake_core import make_fake_core
from fulcrum.engine.core_client import CoreClient
async def main():
    c = CoreClient(make_fake_core)
    c.start()
    await c.wait_ready(60)
    print(c.pid, flush=True)
    os._exit(0)  # the parent dies without any cleanup
asyncio.run(main())
"""


def test_core_exits_when_parent_dies() -> None:
    paths = [os.path.dirname(__file__), *sys.path]
    out = subprocess.run(
        [sys.executable, "-c", _ORPHAN_SCRIPT.format(paths=paths)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    child = int(out.stdout.strip().splitlines()[-1])
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)
