"""Turn a trace's overlap and shape into ``fulcrum serve`` flags, each with its reason.

The thresholds are rules of thumb from how the engine spends a step:

* **Prefix cache** from ``CACHE_OVERLAP`` of prompt tokens served from cache; off below it (no
  hits to pay for the hashing). **Longest-prefix-match scheduling** only where the cache is too
  small for the shared prefixes (the bounded overlap, simulated in arrival order, well below the
  unbounded one) and the unbounded overlap is at least ``LPM_OVERLAP`` (60%): then running the
  requests whose prefix is cached first keeps it from being evicted before its next user. Where
  the cache holds every shared prefix, first-come order reaches the same hits and reordering
  only moves the wait between requests (BENCHMARKS.md §2 and §11 measure both cases).
* **Chunk size** (``--max-num-batched-tokens``): the p90 prompt rounded up to a power of two,
  clamped to [2048, 8192], so most prompts prefill in one step while a long one is chunked and
  cannot stall running decodes for long.
* **Batch limit** (``--max-num-seqs``): 1.5x the mean concurrency (Little's law: arrival rate x
  mean end-to-end latency, when the log has both), rounded up to a power of two in [16, 1024].
* **Context limit** (``--max-model-len``): longest prompt + longest output, rounded up to a power
  of two (no request of the trace is rejected).
* **Speculative decoding** pays when decode dominates (mean output >= 64 tokens) at low
  concurrency (<= 8 running): steps are bound by weight reads and idle compute is free.
  It costs throughput in large batches, where steps are already compute-heavy.
* **FP8** KV cache pays when the cache cannot hold the working set (the overlap at the given
  capacity is clearly below the unbounded one, or concurrency x mean context exceeds the
  capacity); FP8 weights pay for decode-heavy, low-concurrency traffic (bandwidth-bound), on
  GPUs with FP8 units (sm89+).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

from fulcrum.analyze.overlap import OverlapReport
from fulcrum.analyze.stats import TraceStats

LPM_OVERLAP = 0.60
CACHE_OVERLAP = 0.05
SPEC_MIN_OUTPUT = 64
SPEC_MAX_CONCURRENCY = 8.0
DEFAULT_PREFILL_TPS = 8000.0
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"  # what `fulcrum serve` without --model serves  # tokens/s assumed when the log gives no TTFTs to fit


@dataclass
class Recommendation:
    """``flags`` go into ``command``; ``pending_flags`` are advised but not accepted by this
    build's ``fulcrum serve`` (the feature has not landed), so they stay out of it."""

    flags: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    pending_flags: list[str] = field(default_factory=list)
    mean_ttft_saved_s: float = 0.0
    total_prefill_saved_s: float = 0.0
    prefill_s_per_token: float = 0.0
    prefill_rate_source: str = "assumed"  # "fitted" on the log's TTFTs | "given" | "assumed"
    est_concurrency: float | None = None
    command: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def _pow2ceil(x: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(x, 1.0))))


def _clamp(x: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, x))


def recommend(
    stats: TraceStats,
    overlap: OverlapReport,
    unbounded: OverlapReport,
    *,
    model: str | None = None,
    mean_e2e_s: float | None = None,
    prefill_s_per_token: float | None = None,
    prefill_tps: float | None = None,
    serve_flags: set[str] | None = None,
) -> Recommendation:
    """Flags and reasons for serving this trace; ``prefill_s_per_token`` None means assumed.

    ``serve_flags``: the option strings this build's ``fulcrum serve`` accepts (given by the
    command line that holds both subcommands); flags outside it move to ``pending_flags``. None:
    unknown, every flag is kept."""
    rec = Recommendation()
    ov, ov_inf = overlap.overlap, unbounded.overlap
    cap = overlap.capacity_tokens
    cap_txt = "unbounded" if cap is None else f"{cap:,} tokens"

    capacity_limited = cap is not None and ov_inf - ov > 0.05 and ov_inf > ov * 1.2
    if capacity_limited and ov_inf >= LPM_OVERLAP:
        rec.flags += ["--enable-prefix-caching", "--schedule-policy", "lpm"]
        rec.reasons.append(
            f"{ov_inf:.0%} of prompt tokens share a prefix, but a {cap_txt} cache taken in "
            f"arrival order serves only {ov:.0%}: the shared prefixes do not fit together. "
            "Keep the prefix cache on and schedule by longest prefix match, so requests whose "
            "prefix is cached run before it is evicted."
        )
    elif max(ov, ov_inf) >= CACHE_OVERLAP:
        rec.flags.append("--enable-prefix-caching")
        fit = (
            "the cache holds the shared prefixes, so first-come order already reaches these "
            "hits and reordering the queue (lpm) would only move the wait between requests"
            if not capacity_limited
            else f"below {LPM_OVERLAP:.0%} reordering the queue (lpm) is not worth its unfairness"
        )
        rec.reasons.append(f"{ov:.0%} prefix overlap ({cap_txt} cache): keep the cache on; {fit}.")
    else:
        rec.flags.append("--no-enable-prefix-caching")
        rec.reasons.append(
            f"{ov:.1%} prefix overlap: almost nothing to reuse; the prefix cache only costs "
            "hashing and keeps stale blocks."
        )
    if capacity_limited:
        rec.reasons.append(
            f"The cache is too small for this traffic: unbounded it would serve {ov_inf:.0%} "
            f"instead of {ov:.0%}. Give the KV cache more memory (--gpu-memory-utilization), "
            "store it in FP8, or keep what the device evicts in host memory "
            "(--host-kv-cache-memory GiB: prefixes copied back instead of recomputed)."
        )

    p90 = stats.prompt_len.p90
    mbt = _clamp(_pow2ceil(p90), 2048, 8192)
    rec.flags += ["--max-num-batched-tokens", str(mbt)]
    rec.reasons.append(
        f"Prompts: p50 {stats.prompt_len.p50:.0f}, p90 {p90:.0f}, max "
        f"{stats.prompt_len.max:.0f} tokens: a {mbt}-token step budget prefills 90% of prompts "
        "in one step and chunks the rest so decodes keep running."
    )
    out = stats.output_len
    if stats.prompt_len.count and out.count:
        longest = stats.prompt_len.max + out.max
        mml = _pow2ceil(longest)
        rec.flags += ["--max-model-len", str(mml)]
        rec.reasons.append(
            f"The longest prompt plus the longest output is {longest:.0f} tokens: "
            f"--max-model-len {mml} admits every request of the trace and bounds each one's "
            "KV reservation."
        )

    conc = None
    if (
        stats.arrival is not None
        and mean_e2e_s is not None
        and math.isfinite(stats.arrival.request_rate)
    ):
        conc = stats.arrival.request_rate * mean_e2e_s
        rec.est_concurrency = conc
        seqs = _clamp(_pow2ceil(1.5 * conc), 16, 1024)
        rec.flags += ["--max-num-seqs", str(seqs)]
        rec.reasons.append(
            f"{stats.arrival.request_rate:.2f} req/s x {mean_e2e_s:.2f} s mean latency = "
            f"{conc:.1f} requests in flight on average: --max-num-seqs {seqs} leaves headroom "
            f"for bursts (burstiness {_fmt_opt(stats.arrival.burstiness)}; 1 is Poisson)."
        )

    decode_heavy = out.count > 0 and out.mean >= SPEC_MIN_OUTPUT
    if decode_heavy and conc is not None and conc <= SPEC_MAX_CONCURRENCY:
        spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
        rec.flags += ["--speculative-config", f"'{json.dumps(spec, separators=(',', ':'))}'"]
        rec.reasons.append(
            f"Decode-heavy ({out.mean:.0f} output tokens on average) at about {conc:.1f} "
            "concurrent requests: steps are bound by weight reads, so speculative decoding "
            "turns idle compute into tokens."
        )
        rec.reasons.append(
            "FP8 weights (--quantization fp8, on sm89+ GPUs) would also pay here: low-batch "
            "decode reads every weight each step."
        )
    elif decode_heavy:
        why = "unknown concurrency" if conc is None else f"{conc:.0f} concurrent requests"
        rec.reasons.append(
            f"Speculative decoding not recommended ({why}): it pays only at low concurrency, "
            "where decode is bound by weight reads."
        )
    working_set = (conc or 0.0) * (stats.prompt_len.mean + out.mean)
    if capacity_limited or (cap is not None and working_set > cap):
        rec.flags += ["--kv-cache-dtype", "fp8"]
        rec.reasons.append(
            "FP8 KV cache doubles the tokens the cache holds "
            f"(working set ~{working_set:,.0f} tokens vs capacity {cap_txt})."
        )

    if prefill_tps is not None:
        rec.prefill_s_per_token, rec.prefill_rate_source = 1.0 / prefill_tps, "given"
    elif prefill_s_per_token is not None:
        rec.prefill_s_per_token, rec.prefill_rate_source = prefill_s_per_token, "fitted"
    else:
        rec.prefill_s_per_token = 1.0 / DEFAULT_PREFILL_TPS
    hits = overlap.per_request_hits
    rec.total_prefill_saved_s = sum(hits) * rec.prefill_s_per_token
    rec.mean_ttft_saved_s = rec.total_prefill_saved_s / len(hits) if hits else 0.0
    src = {
        "fitted": "fitted on the log's TTFTs",
        "given": "the given prefill rate",
        "assumed": f"assuming {DEFAULT_PREFILL_TPS:.0f} prefill tokens/s; pass --prefill-tps",
    }[rec.prefill_rate_source]
    rec.reasons.append(
        f"Estimated TTFT saved by the cache: {rec.mean_ttft_saved_s * 1000:.1f} ms per request "
        f"on average ({rec.prefill_s_per_token * 1e6:.1f} us per prompt token, {src})."
    )
    _split_supported(rec, serve_flags)
    model_flag = ["--model", model] if model and model != DEFAULT_SERVED_NAME else []
    rec.command = " ".join(["fulcrum", "serve", *model_flag, *rec.flags])
    return rec


def _split_supported(rec: Recommendation, supported: set[str] | None) -> None:
    """Move flags (with their values) that ``fulcrum serve`` does not accept to pending."""
    if supported is None:
        return
    kept: list[str] = []
    current: list[str] = []
    groups: list[list[str]] = []
    for item in rec.flags:
        if item.startswith("--"):
            current = [item]
            groups.append(current)
        else:
            current.append(item)
    for g in groups:
        (kept if g[0] in supported else rec.pending_flags).extend(g)
    if rec.pending_flags:
        rec.reasons.append(
            "Not yet accepted by this build's fulcrum serve, so left out of the command: "
            + " ".join(rec.pending_flags)
        )
    rec.flags = kept


def _fmt_opt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"
