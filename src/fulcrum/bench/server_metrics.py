"""Server-side figures scraped from a Prometheus ``/metrics`` endpoint, when there is one.

fulcrum's names (``fulcrum:*``) are read first, then vLLM's (``vllm:*``), then SGLang's
(``sglang:*``). Gauges are sampled during a run (max and mean); counters are differenced
between the scrape before and the scrape after the run:

* ``kv_cache_usage``: ``fulcrum:kv_cache_usage_perc`` / ``vllm:kv_cache_usage_perc``
  (``vllm:gpu_cache_usage_perc`` on older vLLM) / ``sglang:token_usage``; a fraction in [0, 1].
* ``prefix_cache_hit_rate``: delta hits / delta queries of ``*:prefix_cache_{hits,queries}_total``;
  SGLang's ``sglang:cache_hit_rate`` gauge (mean over the samples) otherwise.
* ``preemptions``: delta of ``*:num_preemptions_total``.
* ``spec_decode_mean_acceptance_length``: 1 + delta accepted / delta drafts of
  ``*:spec_decode_num_{accepted_tokens,drafts}_total`` (tokens a verify step emits); only when
  the server exposes them and verified guesses during the run.
* ``peak_gpu_memory_bytes``: the largest sample of any gauge whose name has ``gpu`` or ``cuda``
  and ``memory`` and ends in ``bytes`` (fulcrum/vLLM/SGLang do not agree on one name).
"""

from __future__ import annotations

import asyncio
import math
import re
from dataclasses import asdict, dataclass, field

import httpx

PREFIXES = ("fulcrum", "vllm", "sglang")
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)")


def parse_prometheus(text: str) -> dict[str, list[float]]:
    """Metric name -> values of its label sets (comments and bad lines skipped)."""
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line.strip())
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if math.isfinite(value):
            out.setdefault(m.group(1), []).append(value)
    return out


def _first(sample: dict[str, list[float]], names: list[str], agg=sum) -> float | None:
    for n in names:
        if n in sample:
            return float(agg(sample[n]))
    return None


def _names(suffix: str) -> list[str]:
    return [f"{p}:{suffix}" for p in PREFIXES]


def server_kind(sample: dict[str, list[float]]) -> str:
    for p in PREFIXES:
        if any(k.startswith(p + ":") for k in sample):
            return p
    return "unknown"


def kv_usage(sample: dict[str, list[float]]) -> float | None:
    names = _names("kv_cache_usage_perc") + ["vllm:gpu_cache_usage_perc", "sglang:token_usage"]
    return _first(sample, names, max)


def gpu_memory(sample: dict[str, list[float]]) -> float | None:
    vals = [
        max(v)
        for k, v in sample.items()
        if ("gpu" in k or "cuda" in k) and "memory" in k and k.endswith("bytes") and v
    ]
    return max(vals) if vals else None


@dataclass
class ServerFigures:
    source: str
    kv_cache_usage_max: float | None = None
    kv_cache_usage_mean: float | None = None
    prefix_cache_hit_rate: float | None = None
    prefix_cache_queries: float | None = None
    preemptions: float | None = None
    spec_decode_num_drafts: float | None = None
    spec_decode_mean_acceptance_length: float | None = None
    peak_gpu_memory_bytes: float | None = None
    num_samples: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class MetricsScraper:
    """Scrape before, during (every ``interval_s``) and after one run."""

    client: httpx.AsyncClient
    url: str
    interval_s: float = 0.5
    available: bool = True
    samples: list[dict[str, list[float]]] = field(default_factory=list)
    _task: asyncio.Task | None = None

    async def scrape(self) -> dict[str, list[float]] | None:
        if not self.available:
            return None
        try:
            resp = await self.client.get(self.url, timeout=10.0)
        except httpx.HTTPError:
            return None
        if resp.status_code != 200:
            self.available = False
            return None
        sample = parse_prometheus(resp.text)
        if not sample:
            self.available = False
            return None
        self.samples.append(sample)
        return sample

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.scrape()

    async def start(self) -> None:
        self.samples = []
        await self.scrape()
        if self.available:
            self._task = asyncio.create_task(self._loop())

    async def stop(self) -> ServerFigures | None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        await self.scrape()
        return summarize(self.samples)


def _delta(first: dict, last: dict, names: list[str]) -> float | None:
    a, b = _first(first, names), _first(last, names)
    return None if a is None or b is None else max(b - a, 0.0)


def summarize(samples: list[dict[str, list[float]]]) -> ServerFigures | None:
    """Figures of one run from its samples (first = before, last = after)."""
    if not samples:
        return None
    first, last = samples[0], samples[-1]
    fig = ServerFigures(source=server_kind(last), num_samples=len(samples))
    usage = [u for s in samples if (u := kv_usage(s)) is not None]
    if usage:
        fig.kv_cache_usage_max, fig.kv_cache_usage_mean = max(usage), sum(usage) / len(usage)
    queries = _delta(first, last, _names("prefix_cache_queries_total"))
    hits = _delta(first, last, _names("prefix_cache_hits_total"))
    if queries is not None and hits is not None:
        fig.prefix_cache_queries = queries
        fig.prefix_cache_hit_rate = hits / queries if queries > 0 else 0.0
    else:
        rates = [r for s in samples if (r := _first(s, ["sglang:cache_hit_rate"], max)) is not None]
        fig.prefix_cache_hit_rate = sum(rates) / len(rates) if rates else None
    fig.preemptions = _delta(first, last, _names("num_preemptions_total"))
    drafts = _delta(first, last, _names("spec_decode_num_drafts_total"))
    accepted = _delta(first, last, _names("spec_decode_num_accepted_tokens_total"))
    if drafts and accepted is not None:
        fig.spec_decode_num_drafts = drafts
        fig.spec_decode_mean_acceptance_length = 1.0 + accepted / drafts
    mem = [m for s in samples if (m := gpu_memory(s)) is not None]
    fig.peak_gpu_memory_bytes = max(mem) if mem else None
    return fig
