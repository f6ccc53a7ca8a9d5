"""PNG plots of one or more ``bench serve`` results: throughput and TTFT against concurrency.

One line per results file (its ``label``), so runs of several engines or configurations
overlay. The x axis is a point's ``max_concurrency``, or its measured mean concurrency when the
point was uncapped (a request-rate sweep). Needs matplotlib (``pip install matplotlib``).
"""

from __future__ import annotations

from typing import Any


def _x(point: dict[str, Any]) -> float:
    mc = point.get("max_concurrency")
    return float(mc) if mc else float(point.get("mean_concurrency") or 0.0)


def plot_results(docs: list[dict[str, Any]], path: str, title: str | None = None) -> None:
    """Write ``path`` (PNG): output tok/s, request/s and TTFT p50/p95 against concurrency."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import ScalarFormatter
    except ImportError:
        raise ValueError("plots need matplotlib: pip install matplotlib") from None

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    ax_tok, ax_req, ax_ttft = axes
    for i, doc in enumerate(docs):
        color = f"C{i % 10}"
        label = str(doc.get("label") or f"run {i + 1}")
        pts = sorted(doc["points"], key=_x)
        xs = [_x(p) for p in pts]
        ax_tok.plot(xs, [p["output_throughput"] for p in pts], "o-", color=color, label=label)
        ax_req.plot(xs, [p["request_throughput"] for p in pts], "o-", color=color, label=label)
        ax_ttft.plot(
            xs, [p["ttft_ms"]["p50"] for p in pts], "o-", color=color, label=f"{label} p50"
        )
        ax_ttft.plot(
            xs, [p["ttft_ms"]["p95"] for p in pts], "s--", color=color, label=f"{label} p95"
        )
    for ax, ylabel in (
        (ax_tok, "output tokens/s"),
        (ax_req, "requests/s"),
        (ax_ttft, "TTFT (ms)"),
    ):
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        all_x = [_x(p) for d in docs for p in d["points"]]
        if all_x and min(all_x) > 0 and max(all_x) / min(all_x) >= 10:
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(ScalarFormatter())
    ax_tok.set_title("Output throughput")
    ax_req.set_title("Request throughput")
    ax_ttft.set_title("Time to first token")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
