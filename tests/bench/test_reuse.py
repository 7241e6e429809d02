"""Long-doc with several documents: request i asks about document i mod N, and the reuse
summary sets each document's first request against its repeats."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.bench.records import RequestRecord, RunResult
from pdserve.bench.report import reuse_table, summarize_runs
from pdserve.bench.reuse import summarize_reuse
from pdserve.bench.workloads import TokenSpace, WorkloadSpec, build_prompts


def test_requests_ask_about_the_documents_in_turn() -> None:
    spec = WorkloadSpec("long-doc", 6, input_len=40, shared_prefix_len=32, output_len=2,
                        num_documents=3)
    prompts = build_prompts(spec, TokenSpace(100))
    docs = [p.prompt_ids[:32] for p in prompts]
    assert docs[0] == docs[3] and docs[1] == docs[4] and docs[0] != docs[1] != docs[2]
    single = build_prompts(WorkloadSpec("long-doc", 2, input_len=40, shared_prefix_len=32,
                                        output_len=2), TokenSpace(100))
    assert single[0].prompt_ids[:32] == docs[0]  # one document: the same as before
    later = [p.prompt_ids[:32] for p in build_prompts(spec, TokenSpace(100), round_index=1)]
    assert later[0] == later[3] and not set(map(tuple, later)) & set(map(tuple, docs))
    # one document stays the same in every round
    assert build_prompts(WorkloadSpec("long-doc", 1, input_len=40, shared_prefix_len=32,
                                      output_len=2), TokenSpace(100), 1)[0].prompt_ids[:32] \
        == docs[0]


def record(index: int, ttft_s: float, computed: int, hit: int, tier: str | None) -> RequestRecord:
    return RequestRecord(index, True, 100, 2, ttft_s=ttft_s, e2e_s=ttft_s + 0.1,
                         server_timings=({"prefill_tokens_computed": computed,
                                          "prefix_hit_tokens": hit, "kv_tier": tier,
                                          "kv_loaded_tokens": 64 if tier else 0},))


def test_the_reuse_summary_splits_firsts_from_repeats() -> None:
    records = (record(0, 1.0, 100, 0, None), record(1, 1.2, 100, 0, None),
               record(2, 0.2, 4, 96, "host"), record(3, 0.3, 4, 96, None))
    run = RunResult("tiers", {"name": "long-doc", "num_documents": 2}, {"request_rate": 1.0},
                    {}, 10.0, records)
    summary = summarize_reuse(run)
    assert summary is not None
    assert (summary.num_first, summary.num_repeat) == (2, 2)
    assert summary.repeat_computed_fraction == 0.04 and summary.reuse_ratio == 0.48
    assert summary.loads_by_tier == {"host": 1}
    assert summary.ttft_ratio is not None and summary.ttft_ratio < 0.3
    table = "\n".join(reuse_table(summarize_runs([run])))
    assert "host 1" in table and "4.0%" in table


def test_a_colocated_request_computes_its_prompt_less_the_reused_prefix() -> None:
    colocated = RequestRecord(1, True, 100, 2, ttft_s=0.1, e2e_s=0.2, server_timings=(
        {"prefill_tokens_computed": None, "prefix_hit_tokens": 96, "kv_tier": "host",
         "kv_loaded_tokens": 96},))
    run = RunResult("tiers", {"name": "long-doc", "num_documents": 1}, {"request_rate": 1.0},
                    {}, 10.0, (record(0, 1.0, 100, 0, None), colocated))
    summary = summarize_reuse(run)
    assert summary is not None and summary.repeat_computed_fraction == 0.04
    assert summary.repeat_computed_per_request == 4


def test_the_reuse_plot_draws_firsts_against_repeats(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="plots need matplotlib (pdserve[bench])")
    from pdserve.bench.plots import write_plots

    records = (record(0, 1.0, 100, 0, None), record(1, 0.2, 4, 96, "host"))
    run = RunResult("tiers", {"name": "long-doc", "num_documents": 1}, {"request_rate": 1.0},
                    {}, 10.0, records)
    paths = write_plots(summarize_runs([run]), tmp_path, "long-doc")
    assert tmp_path / "kv_reuse.png" in paths
    assert (tmp_path / "kv_reuse.png").stat().st_size > 5000
