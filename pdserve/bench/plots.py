"""PNG plots of a set of runs: TTFT and TPOT CDFs per setup, goodput vs rate, stacked stage
breakdowns, handoff-time CDF and bytes moved, KV reuse of long-doc documents. Needs
matplotlib (``pip install 'pdserve[bench]'``).
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdserve.bench.breakdown import STAGES
from pdserve.bench.report import SummarizedRun
from pdserve.bench.reuse import summarize_reuse

COLORS = ("#3b7dd8", "#e08a2e", "#5aa469", "#b05bc4", "#c44e52", "#8c8c8c", "#d4a017", "#17becf")
MATPLOTLIB_MISSING = ("plots need matplotlib: pip install 'pdserve[bench]' (or pass --no-plots)")


def require_matplotlib() -> None:
    """Fail before a long run, not after it, when plots cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(MATPLOTLIB_MISSING) from None


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _setups(items: Sequence[SummarizedRun]) -> list[str]:
    return list(dict.fromkeys(i.run.setup for i in items))


def _save(fig: Any, path: Path, title: str) -> Path:
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    _pyplot().close(fig)
    return path


def _cdf(ax: Any, samples: Sequence[float], color: str, label: str) -> None:
    ordered = sorted(v for v in samples if v > 0)
    if ordered:
        ys = [(k + 1) / len(ordered) for k in range(len(ordered))]
        ax.step(ordered, ys, where="post", color=color, label=f"{label} (n={len(ordered)})")


def latency_cdfs(items: Sequence[SummarizedRun], path: Path, title: str) -> Path:
    """One row per rate: TTFT and TPOT CDFs, a line per setup."""
    plt = _pyplot()
    rates = sorted({i.run.request_rate for i in items})
    fig, axes = plt.subplots(len(rates), 2, figsize=(9, 2.8 * len(rates)), squeeze=False)
    setups = _setups(items)
    for row, rate in zip(axes, rates, strict=True):
        for item in (i for i in items if i.run.request_rate == rate):
            color = COLORS[setups.index(item.run.setup) % len(COLORS)]
            ok = [r for r in item.run.records if r.ok]
            _cdf(row[0], [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None], color,
                 item.run.setup)
            _cdf(row[1], [r.tpot_s * 1e3 for r in ok if r.tpot_s and r.output_tokens > 1],
                 color, item.run.setup)
        for ax, name, bound in ((row[0], "TTFT", "ttft_ms"), (row[1], "TPOT", "tpot_ms")):
            slo = items[0].run.slo.get(bound)
            if slo:
                ax.axvline(slo, color="black", linestyle="--", linewidth=0.8, label="SLO")
            ax.set_xscale("log")
            ax.set_xlabel(f"{name} (ms), rate {_rate(rate)} req/s")
            ax.set_ylabel("fraction <= x")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="lower right")
    return _save(fig, path, title)


def goodput_vs_rate(items: Sequence[SummarizedRun], path: Path, title: str) -> Path:
    """Goodput (or, without an SLO, throughput) and SLO attainment against the offered rate."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    has_slo = items[0].summary.request_goodput is not None
    for k, setup in enumerate(_setups(items)):
        mine = [i for i in items if i.run.setup == setup and math.isfinite(i.run.request_rate)]
        rates = [i.run.request_rate for i in mine]
        color = COLORS[k % len(COLORS)]
        values = [(i.summary.request_goodput if has_slo else i.summary.request_throughput)
                  for i in mine]
        left.plot(rates, values, marker="o", color=color, label=setup)
        if has_slo:
            right.plot(rates, [100 * (i.summary.slo_attainment or 0) for i in mine],
                       marker="o", color=color, label=setup)
    left.set_xlabel("offered rate (req/s)")
    left.set_ylabel("goodput (req/s)" if has_slo else "completed (req/s)")
    right.set_xlabel("offered rate (req/s)")
    right.set_ylabel("requests meeting the SLO (%)")
    right.set_ylim(0, 105)
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path, title)


def stage_breakdown(items: Sequence[SummarizedRun], path: Path, title: str) -> Path:
    """A stacked bar per (setup, rate): mean ms of each stage."""
    plt = _pyplot()
    shown = [i for i in items if i.breakdown is not None]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(shown) + 2), 3.8))
    labels = [f"{i.run.setup}\n@{_rate(i.run.request_rate)}/s" for i in shown]
    bottoms = [0.0] * len(shown)
    for k, (name, label) in enumerate(STAGES):
        heights = [i.breakdown.mean_ms[name] for i in shown if i.breakdown is not None]
        ax.bar(labels, heights, bottom=bottoms, color=COLORS[k % len(COLORS)], label=label)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    ax.set_ylabel("mean ms per request")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=7, bbox_to_anchor=(1.01, 1), loc="upper left")
    return _save(fig, path, title)


def handoff(items: Sequence[SummarizedRun], path: Path, title: str) -> Path:
    """Handoff-time CDF per (setup, rate) and the KV bytes moved per handoff."""
    plt = _pyplot()
    shown = [i for i in items if i.breakdown is not None and i.breakdown.handoff_ms]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    for k, item in enumerate(shown):
        assert item.breakdown is not None
        label = f"{item.run.setup} @{_rate(item.run.request_rate)}/s"
        _cdf(left, item.breakdown.handoff_ms, COLORS[k % len(COLORS)], label)
    left.set_xscale("log")
    left.set_xlabel("handoff, ticket to verified fence (ms)")
    left.set_ylabel("fraction <= x")
    left.grid(alpha=0.3)
    left.legend(fontsize=7, loc="lower right")
    names = [f"{i.run.setup}\n@{_rate(i.run.request_rate)}/s" for i in shown]
    per = [(i.breakdown.total_handoff_mib / max(len(i.breakdown.handoff_bytes), 1))
           for i in shown if i.breakdown is not None]
    drawn = right.bar(names, per, color=[COLORS[k % len(COLORS)] for k in range(len(shown))])
    right.bar_label(drawn, fmt="%.2f", fontsize=7)
    right.set_ylabel("MiB moved per handoff (mean)")
    right.tick_params(axis="x", labelsize=7)
    return _save(fig, path, title)


def kv_reuse(items: Sequence[SummarizedRun], path: Path, title: str) -> Path:
    """Per (setup, rate): TTFT p50 of each document's first request and of its repeats, and
    the share of the repeats' prompt tokens computed."""
    plt = _pyplot()
    shown = [(i, r) for i in items if (r := summarize_reuse(i.run)) is not None]
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(8.0, 1.6 * len(shown) + 4), 3.6))
    # Long setup names wrap at their hyphens: side by side they would overlap.
    names = [f"{textwrap.fill(i.run.setup, 14)}\n@{_rate(i.run.request_rate)}/s"
             for i, _ in shown]
    xs = list(range(len(shown)))
    for k, (label, values) in enumerate((
            ("first request (p50)", [r.first_ttft_p50_ms or 0.0 for _, r in shown]),
            ("repeats (p50)", [r.repeat_ttft_p50_ms or 0.0 for _, r in shown]))):
        drawn = left.bar([x + (k - 0.5) * 0.4 for x in xs], values, width=0.4,
                         color=COLORS[k], label=label)
        left.bar_label(drawn, fmt="%.0f", fontsize=7)
    left.set_xticks(xs, names, fontsize=7)
    left.set_ylabel("TTFT (ms)")
    left.legend(fontsize=7)
    fractions = [100.0 * (r.repeat_computed_fraction or 0.0) for _, r in shown]
    drawn = right.bar(names, fractions, color=[COLORS[k % len(COLORS)] for k in xs])
    right.bar_label(drawn, fmt="%.1f%%", fontsize=7)
    right.set_ylabel("repeats' prompt tokens computed (%)")
    right.tick_params(axis="x", labelsize=7)
    for ax in (left, right):
        ax.grid(alpha=0.3, axis="y")
    return _save(fig, path, title)


def write_plots(items: Sequence[SummarizedRun], result_dir: Path, title: str) -> list[Path]:
    """Every plot the runs have data for; returns their paths."""
    if not items:
        return []
    result_dir.mkdir(parents=True, exist_ok=True)
    paths = [latency_cdfs(items, result_dir / "latency_cdf.png", f"{title}: latency CDFs"),
             goodput_vs_rate(items, result_dir / "goodput_vs_rate.png", f"{title}: goodput")]
    if any(i.breakdown is not None for i in items):
        paths.append(stage_breakdown(items, result_dir / "stage_breakdown.png",
                                     f"{title}: stage breakdown"))
    if any(i.breakdown is not None and i.breakdown.handoff_ms for i in items):
        paths.append(handoff(items, result_dir / "handoff.png", f"{title}: KV handoff"))
    if any(summarize_reuse(i.run) is not None for i in items):
        paths.append(kv_reuse(items, result_dir / "kv_reuse.png", f"{title}: KV reuse"))
    return paths
