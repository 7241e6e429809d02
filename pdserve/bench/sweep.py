"""Runs of one workload at several request rates against one server, and the files they leave:
a JSON per run as it finishes, then summary.md and the plots over all runs."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.bench.client import Endpoint
from pdserve.bench.metrics import summarize
from pdserve.bench.records import RunResult, save_run
from pdserve.bench.report import markdown_summary, summarize_runs
from pdserve.bench.runner import LoadSpec, prepare, run_load, warm_up
from pdserve.bench.slo import SLO
from pdserve.bench.workloads import PromptSpec, TokenSpace, WorkloadSpec, build_prompts

if TYPE_CHECKING:
    from pdserve.engine.tokenizer import Tokenizer

WARMUP_ROUND = 1 << 20  # warm-up prompts come from a round no measured run uses
PromptShaper = Callable[[list[PromptSpec]], list[PromptSpec]]


@dataclass(frozen=True)
class Target:
    """One server setup under test."""

    label: str
    endpoint: Endpoint
    tokenizer: Tokenizer
    server: Mapping[str, Any] = field(default_factory=dict)  # recorded in every run file


def _requests(target: Target, prompts: list[PromptSpec]) -> list[Any]:
    texts = ([target.tokenizer.decode(p.prompt_ids) for p in prompts]
             if target.endpoint.api == "chat" else None)
    return prepare(target.endpoint, prompts, texts)


def sweep(target: Target, workload: WorkloadSpec, rates: Sequence[float], load: LoadSpec,
          slo: SLO, num_warmups: int, result_dir: Path,
          shape: PromptShaper | None = None) -> list[RunResult]:
    """One run per rate (round k of the workload at the k-th rate, so every setup of a
    comparison sees the same prompts at the same rate); each run's JSON is written at once."""
    space = TokenSpace.of(target.tokenizer)
    shape = shape or (lambda prompts: prompts)
    runs = []
    for k, rate in enumerate(rates):
        if num_warmups:
            warm = build_prompts(dataclasses.replace(workload, num_prompts=num_warmups), space,
                                 WARMUP_ROUND)
            failed = warm_up(target.endpoint, _requests(target, shape(warm)), load)
            if failed:
                print(f"  warning: {failed} of {num_warmups} warm-up requests failed")
        rate_load = dataclasses.replace(load, request_rate=rate, seed=load.seed + k)
        requests = _requests(target, shape(build_prompts(workload, space, round_index=k)))
        started, load_before = time.time(), os.getloadavg()[0]
        records, duration = run_load(target.endpoint, requests, rate_load,
                                     label=f"{target.label} @{rate:g}/s")
        run = RunResult(target.label, workload.to_json(), rate_load.to_json(), slo.as_dict(),
                        duration, tuple(records), target.server, started,
                        (load_before, os.getloadavg()[0]))
        summary = summarize(records, duration, slo)
        save_run(run, result_dir, summary.to_json())
        goodput = "" if summary.request_goodput is None else \
            f", goodput {summary.request_goodput:.2f} req/s ({summary.slo_attainment:.0%} met SLO)"
        print(f"  {target.label} @{rate:g}/s: {summary.completed}/{summary.num_requests} ok, "
              f"{summary.failed} failed, {summary.request_throughput:.2f} req/s, TTFT p50 "
              f"{summary.ttft.p50_ms:.0f} ms, TPOT p50 {summary.tpot.p50_ms:.1f} ms{goodput}",
              flush=True)
        runs.append(run)
    return runs


def write_report(runs: Sequence[RunResult], result_dir: Path, *, plots: bool,
                 baseline: str | None = None, title: str | None = None) -> str:
    """summary.md (returned) and the plots of every run in ``runs``; the title names the
    workloads unless given."""
    items = summarize_runs(runs)
    workloads = sorted({str(r.workload.get("name")) for r in runs})
    title = title or f"pdserve bench: {', '.join(workloads)}"
    text = markdown_summary(items, baseline, title)
    result_dir.mkdir(parents=True, exist_ok=True)
    (result_dir / "summary.md").write_text(text)
    written = [result_dir / "summary.md"]
    if plots:
        from pdserve.bench.plots import write_plots

        written += write_plots(items, result_dir, title)
    print(text)
    print("wrote " + ", ".join(str(p) for p in written))
    return text
