"""The Markdown summary of a set of runs (setups x rates): figures, goodput ratios against a
baseline setup, the server's stage breakdown and handoff costs, and every error kind."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.bench.breakdown import STAGES, Breakdown, breakdown
from pdserve.bench.metrics import RunSummary, summarize
from pdserve.bench.records import RunResult
from pdserve.bench.reuse import summarize_reuse
from pdserve.bench.slo import SLO


@dataclass(frozen=True)
class SummarizedRun:
    run: RunResult
    summary: RunSummary
    breakdown: Breakdown | None


def summarize_runs(runs: Sequence[RunResult]) -> list[SummarizedRun]:
    """Each run with its figures, ordered by setup (a comparison's order, else as first seen)
    and then rate."""
    seen = {setup: i for i, setup in enumerate(dict.fromkeys(r.setup for r in runs))}
    order = {r.setup: (r.server.get("order", len(seen)), seen[r.setup]) for r in runs}
    ordered = sorted(runs, key=lambda r: (order[r.setup], r.request_rate))
    return [SummarizedRun(r, summarize(r.records, r.duration_s, SLO(**r.slo)), breakdown(r.records))
            for r in ordered]


def _f(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}"


def _rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    align = ["---"] + ["---:"] * (len(header) - 1)
    return ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |",
            *("| " + " | ".join(row) + " |" for row in rows)]


def figures_table(items: Sequence[SummarizedRun]) -> list[str]:
    rows = []
    for item in items:
        s = item.summary
        rows.append([item.run.setup, _rate(item.run.request_rate), str(s.num_requests),
                     str(s.failed), _f(s.request_throughput, 2), _f(s.output_throughput),
                     f"{_f(s.ttft.p50_ms)} / {_f(s.ttft.p99_ms)}",
                     f"{_f(s.tpot.p50_ms)} / {_f(s.tpot.p99_ms)}", _f(s.itl.p99_ms),
                     f"{_f(s.e2el.p50_ms)} / {_f(s.e2el.p99_ms)}",
                     "-" if s.slo_attainment is None else f"{s.slo_attainment:.0%}",
                     _f(s.request_goodput, 2)])
    return _table(["setup", "rate (req/s)", "requests", "failed", "done/s", "out tok/s",
                   "TTFT p50 / p99 (ms)", "TPOT p50 / p99 (ms)", "ITL p99 (ms)",
                   "E2E p50 / p99 (ms)", "SLO met", "goodput (req/s)"], rows)


def ratio_table(items: Sequence[SummarizedRun], baseline: str) -> list[str]:
    """Goodput of every setup over the baseline's at each rate both ran."""
    setups = list(dict.fromkeys(i.run.setup for i in items))
    by = {(i.run.setup, i.run.request_rate): i.summary.request_goodput for i in items}
    rates = sorted({i.run.request_rate for i in items})
    rows = []
    for rate in rates:
        base = by.get((baseline, rate))
        cells = [_rate(rate)]
        for setup in setups:
            value = by.get((setup, rate))
            ratio = (f" ({value / base:.2f}x)" if value is not None and base else "")
            cells.append(f"{_f(value, 2)}{ratio}")
        rows.append(cells)
    return _table(["rate (req/s)", *setups], rows)


def breakdown_table(items: Sequence[SummarizedRun]) -> list[str]:
    rows = [[i.run.setup, _rate(i.run.request_rate), str(i.breakdown.num_requests),
             *(_f(i.breakdown.mean_ms[name]) for name, _ in STAGES)]
            for i in items if i.breakdown is not None]
    return _table(["setup", "rate", "requests", *(label for _, label in STAGES)], rows)


def handoff_table(items: Sequence[SummarizedRun]) -> list[str]:
    rows = []
    for i in items:
        b = i.breakdown
        if b is None:
            continue
        per_request = b.total_handoff_mib / len(b.handoff_bytes) if b.handoff_bytes else None
        hit = b.prefix_hit_tokens / b.prompt_tokens if b.prompt_tokens else None
        paths = ", ".join(f"{k} {v}" for k, v in sorted(b.paths.items()))
        rows.append([i.run.setup, _rate(i.run.request_rate), paths, str(len(b.handoff_ms)),
                     f"{_f(b.handoff_p50_ms)} / {_f(b.handoff_p99_ms)}",
                     _f(b.total_handoff_mib), _f(per_request, 2),
                     "-" if hit is None else f"{hit:.0%}"])
    return _table(["setup", "rate", "paths", "handoffs", "handoff p50 / p99 (ms)",
                   "MiB moved", "MiB per handoff", "prefix hit"], rows)


def reuse_table(items: Sequence[SummarizedRun]) -> list[str]:
    """First request of each document against its repeats (long-doc with documents)."""
    rows = []
    for i in items:
        r = summarize_reuse(i.run)
        if r is None:
            continue
        tiers = ", ".join(f"{k} {v}" for k, v in sorted(r.loads_by_tier.items())) or "-"
        frac = "-" if r.repeat_computed_fraction is None else f"{r.repeat_computed_fraction:.1%}"
        ratio = "-" if r.reuse_ratio is None else f"{r.reuse_ratio:.0%}"
        rows.append([i.run.setup, _rate(i.run.request_rate),
                     f"{_f(r.first_ttft_p50_ms)} / {_f(r.first_ttft_p90_ms)}",
                     f"{_f(r.repeat_ttft_p50_ms)} / {_f(r.repeat_ttft_p90_ms)}",
                     _f(r.ttft_ratio, 2), _f(r.first_computed_per_request, 0),
                     _f(r.repeat_computed_per_request, 0), frac, ratio, tiers])
    return _table(["setup", "rate", "first TTFT p50 / p90 (ms)", "repeat TTFT p50 / p90 (ms)",
                   "repeat / first p50", "computed per first", "computed per repeat",
                   "repeat computed", "reuse ratio", "loads by tier"], rows)


def _load_range(items: Sequence[SummarizedRun]) -> str:
    values = [v for i in items for v in i.run.load_average if v > 0]
    return f"{min(values):.1f} to {max(values):.1f}" if values else "not recorded"


def markdown_summary(items: Sequence[SummarizedRun], baseline: str | None = None,
                     title: str = "pdserve bench") -> str:
    if not items:
        return f"# {title}\n\nNo runs.\n"
    first = items[0].run
    workload = ", ".join(f"{k}={v}" for k, v in first.workload.items() if v is not None)
    lines = [f"# {title}", "", f"- workload: {workload}",
             f"- SLO: {SLO(**first.slo).describe()}",
             f"- load: burstiness {first.load.get('burstiness')}, max concurrency "
             f"{first.load.get('max_concurrency') or 'none'}, seed {first.load.get('seed')}",
             "- latencies count from each request's send; TPOT = (E2E - TTFT) / (tokens - 1); "
             "goodput = requests meeting every SLO bound per second of the run",
             f"- machine load average (1 min) during the runs: {_load_range(items)}", "",
             *figures_table(items)]
    setups = list(dict.fromkeys(i.run.setup for i in items))
    if first.slo and not SLO(**first.slo).is_empty and len(setups) > 1:
        base = baseline if baseline in setups else setups[0]
        lines += ["", f"## Goodput (req/s), ratio to {base}", "", *ratio_table(items, base)]
    if any(i.breakdown is not None for i in items):
        lines += ["", "## Where the time went (server stage timings, mean ms per request)", "",
                  *breakdown_table(items), "", "## KV handoff", "", *handoff_table(items)]
    if any(summarize_reuse(i.run) is not None for i in items):
        lines += ["", "## KV reuse (each document's first request against its repeats)", "",
                  *reuse_table(items)]
    errors = [(i.run.setup, _rate(i.run.request_rate), kind, n)
              for i in items for kind, n in i.summary.errors.items()]
    if errors:
        lines += ["", "## Failed requests", "",
                  *_table(["setup", "rate", "error", "count"],
                          [[s, r, k, str(n)] for s, r, k, n in errors])]
    return "\n".join(lines) + "\n"
