"""Load through the real server: many concurrent streams; disconnects free their KV blocks."""

from __future__ import annotations

import asyncio
import random

import openai
from srv_helpers import API_KEY, MODEL, Server, wait_idle


def _client(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=600
    )


async def _stream(
    client: openai.AsyncOpenAI, i: int, max_tokens: int, disconnect_after: int | None
) -> tuple[str | None, int]:
    """Finish reason (None if we hung up) and number of completion tokens reported.

    Short distinct prompts through /v1/completions keep prefill negligible on a CPU, so the
    test measures the server (connections, streams, aborts), not the model."""
    stream = await client.completions.create(
        model=MODEL,
        prompt=f"{i}:",
        max_tokens=max_tokens,
        temperature=0.7,
        seed=i,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    reason, tokens, seen = None, -1, 0
    async for chunk in stream:
        for c in chunk.choices:
            if c.text:
                seen += 1
            if c.finish_reason is not None:
                assert reason is None, "two finish reasons for one choice"
                reason = c.finish_reason
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if disconnect_after is not None and seen >= disconnect_after:
            await stream.close()
            return None, -1
    return reason, tokens


def test_500_concurrent_streams(server: Server) -> None:
    async def main() -> list[tuple[str | None, int]]:
        client = _client(server)
        try:
            return await asyncio.gather(*[_stream(client, i, 2, None) for i in range(500)])
        finally:
            await client.close()

    results = asyncio.run(main())
    assert all(r == ("length", 2) for r in results), [r for r in results if r != ("length", 2)][:5]
    wait_idle(server)


def _finished_by_reason(server: Server) -> dict[str, float]:
    _, data, _ = server.request("GET", "/metrics")
    out: dict[str, float] = {}
    for line in data.decode().splitlines():
        if line.startswith("fulcrum:request_success_total{"):
            reason = line.split('finished_reason="')[1].split('"')[0]
            out[reason] = out.get(reason, 0.0) + float(line.rpartition(" ")[2])
    return out


def test_disconnects_free_kv_blocks_and_spare_the_others(server: Server) -> None:
    before = _finished_by_reason(server)
    rng = random.Random(0)
    quitters = set(rng.sample(range(200), 60))  # 30%

    async def main() -> list[tuple[str | None, int]]:
        client = _client(server)
        try:
            jobs = [_stream(client, i, 8, 2 if i in quitters else None) for i in range(200)]
            return await asyncio.gather(*jobs)
        finally:
            await client.close()

    results = asyncio.run(main())
    for i, r in enumerate(results):
        assert r == ((None, -1) if i in quitters else ("length", 8)), (i, r)
    m = wait_idle(server)
    assert m["fulcrum:kv_cache_blocks_free"] == m["fulcrum:kv_cache_blocks_total"]
    # every request counted once: a hang-up as "abort" (unless it finished first)
    after = _finished_by_reason(server)
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    assert sum(delta.values()) == 200
    assert delta.get("abort", 0) >= 1 and delta.get("length", 0) >= 140


def test_nonstreaming_disconnect_is_aborted(server: Server) -> None:
    before = server.metrics()["fulcrum:generation_tokens_total"]

    async def main() -> None:
        client = openai.AsyncOpenAI(
            base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=2.0
        )
        try:
            await client.completions.create(
                model=MODEL,
                prompt="Write a long story.",
                max_tokens=1000,
                extra_body={"ignore_eos": True},
            )
        except openai.APITimeoutError:
            pass
        finally:
            await client.close()

    asyncio.run(main())
    wait_idle(server, timeout=60)
    # Idle long before the 1000 tokens it asked for: the hang-up aborted it.
    assert server.metrics()["fulcrum:generation_tokens_total"] - before < 1000
