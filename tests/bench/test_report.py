"""Run files round-trip, the server's stage breakdown adds up as worked out by hand, and the
summary's goodput ratios; `bench report` re-judges saved requests by other SLO bounds."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pdserve.bench.breakdown import breakdown, request_stages
from pdserve.bench.metrics import summarize
from pdserve.bench.records import RequestRecord, RunResult, load_runs, save_run
from pdserve.bench.report import markdown_summary, summarize_runs
from pdserve.bench.slo import SLO
from pdserve.cli import main

TIMINGS = {"path": "disaggregated", "tokenize_ms": 1.0, "decode_reserve_ms": 2.0,
           "prefill_queue_ms": 3.0, "prefill_compute_ms": 4.0, "ttft_ms": 15.0, "e2e_ms": 100.0,
           "handoff_exposed_ms": 10.0, "handoff_ms": 12.0, "handoff_bytes": 2 ** 20,
           "prefix_hit_tokens": 32, "num_prompt_tokens": 64}


def record(i: int, ttft: float, e2e: float, tokens: int = 3, **kw) -> RequestRecord:
    return RequestRecord(i, True, 64, tokens, ttft_s=ttft, e2e_s=e2e,
                         chunk_times_s=(ttft, e2e), **kw)


TTFT_100 = SLO(ttft_ms=100)


def run(setup: str, rate: float, records: list[RequestRecord], slo: SLO = TTFT_100):
    return RunResult(setup, {"name": "random", "num_prompts": len(records)},
                     {"request_rate": rate, "burstiness": 1.0, "seed": 0}, slo.as_dict(), 2.0,
                     tuple(records))


def test_stages_split_the_client_e2e() -> None:
    stages = request_stages(record(0, 0.02, 0.11, server_timings=(TIMINGS,)))
    # first token, other = 15 - (1+2+3+4); decode = 100 - 15 - 10; client = 110 - 100
    assert stages == pytest.approx({"tokenize": 1, "decode_reserve": 2, "prefill_queue": 3,
                                    "prefill_compute": 4, "first_token_other": 5,
                                    "handoff_exposed": 10, "decode": 75,
                                    "client_overhead": 10})
    b = breakdown([record(0, 0.02, 0.11, server_timings=(TIMINGS,)), record(1, 0.02, 0.11),
                   RequestRecord(2, False, 64, error="HTTP 500")])
    assert b is not None and b.num_requests == 1 and b.paths == {"disaggregated": 1}
    assert b.total_handoff_mib == 1.0 and b.handoff_p50_ms == 12.0
    assert breakdown([record(1, 0.02, 0.11)]) is None  # another server: no breakdown


def test_run_files_round_trip(tmp_path: Path) -> None:
    original = run("a", math.inf, [record(0, 0.05, 0.2, server_timings=(TIMINGS,)),
                                   RequestRecord(1, False, 64, error="HTTP 429: busy")])
    save_run(original, tmp_path, summarize(original.records, 2.0, SLO()).to_json())
    [loaded] = load_runs(tmp_path)
    assert loaded == original and math.isinf(loaded.request_rate)


def test_goodput_ratios_against_the_baseline() -> None:
    fast, slow = record(0, 0.05, 0.2), record(1, 0.5, 0.9)  # TTFT 50 ms meets 100; 500 misses
    runs = [run("colo", 1.0, [fast, slow]), run("disagg", 1.0, [fast, fast]),
            run("colo", 2.0, [fast, slow, slow, slow]), run("disagg", 2.0, [fast, fast, slow])]
    text = markdown_summary(summarize_runs(runs), baseline="colo")
    # Over 2 s: colo 1 good -> 0.5/s, disagg 2 -> 1.0/s (2.00x); at 2/s: 0.5 vs 1.0 again.
    assert "| 1 | 0.50 (1.00x) | 1.00 (2.00x) |" in text
    assert "| 2 | 0.50 (1.00x) | 1.00 (2.00x) |" in text
    assert "| colo | 2 | 4 | 0 |" in text


def test_report_rejudges_saved_requests(tmp_path: Path) -> None:
    original = run("a", 1.0, [record(0, 0.05, 0.2), record(1, 0.5, 0.9)])
    save_run(original, tmp_path, {})
    assert main(["bench", "report", str(tmp_path), "--no-plots", "--goodput", "ttft:1000"]) == 0
    text = (tmp_path / "summary.md").read_text()
    assert "SLO: ttft <= 1000 ms" in text and "| 100% | 1.00 |" in text
