"""The load client against a real HTTP server: every chunk timed, usage and pdserve's stage
timings read, and `pdserve bench` counting refused and broken requests as failures."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from pdserve.bench.arrivals import arrival_times
from pdserve.bench.client import Endpoint, send_request
from pdserve.bench.runner import LoadSpec, prepare, run_load
from pdserve.bench.workloads import PromptSpec
from pdserve.cli import main
from tests.bench.fake_openai import FakeServer, serving


def _one(server: FakeServer, endpoint: Endpoint, prompt: PromptSpec):
    async def go():
        async with httpx.AsyncClient(trust_env=False) as client:
            return await send_request(client, endpoint, endpoint.body(prompt), 0,
                                      len(prompt.prompt_ids), 0.0, 0.0)
    return asyncio.run(go())


def test_a_stream_is_timed_chunk_by_chunk_with_server_timings() -> None:
    with serving(FakeServer(lambda n: None, token_delay_s=0.01)) as server:
        endpoint = Endpoint(server.url + "/v1", "fake-model", server_timings=True,
                            api_key="sk-test")
        record = _one(server, endpoint, PromptSpec(tuple(range(3, 40)), 6))
    assert record.ok and record.error is None
    assert (record.prompt_tokens, record.output_tokens) == (37, 6)
    assert len(record.chunk_times_s) == 6 and record.ttft_s == record.chunk_times_s[0]
    assert len(record.itl_s) == 5 and all(gap >= 0 for gap in record.itl_s)
    assert record.e2e_s >= max(record.chunk_times_s[-1], 0.06)  # 6 tokens, 10 ms sleep each
    [timings] = record.server_timings
    assert timings["path"] == "disaggregated" and timings["handoff_bytes"] == 65536
    body = server.bodies[0]
    assert body["prompt"] == list(range(3, 40)) and body["max_tokens"] == 6
    assert body["ignore_eos"] is True and body["pdserve_timings"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert server.auth_headers == ["Bearer sk-test"]


def test_without_asking_no_timings_are_sent_or_read() -> None:
    with serving(FakeServer(lambda n: None)) as server:
        record = _one(server, Endpoint(server.url, "fake-model"), PromptSpec((5, 6, 7), 2))
    assert record.ok and record.server_timings == ()
    assert "pdserve_timings" not in server.bodies[0] and server.auth_headers == [None]


def refusals(n: int) -> str | None:
    if n % 4 == 1:
        return "429"
    if n % 5 == 3:
        return "500"
    return "midstream" if n % 7 == 5 else None


def test_bench_counts_every_refused_and_broken_request(tmp_path: Path,
                                                       tiny_checkpoints: dict[str, str]) -> None:
    num = 24
    expected = [refusals(n) for n in range(num)]
    with serving(FakeServer(refusals)) as server:
        code = main(["bench", "--base-url", server.url, "--tokenizer", tiny_checkpoints["llama"],
                     "--workload", "random", "--input-len", "16", "--output-len", "4",
                     "--num-prompts", str(num), "--max-concurrency", "4", "--server-timings",
                     "--goodput", "ttft:5000", "--result-dir", str(tmp_path), "--label", "fake"])
    assert code == 0
    [run_file] = tmp_path.glob("*.run.json")
    run = json.loads(run_file.read_text())
    assert len(run["requests"]) == num  # nothing dropped
    errors = [r["error"].split(":")[0] for r in run["requests"] if not r["ok"]]
    assert errors.count("HTTP 429") == expected.count("429")
    assert errors.count("HTTP 500") == expected.count("500")
    assert errors.count("in-stream error") == expected.count("midstream")
    summary = run["summary"]
    failed = num - expected.count(None)
    assert (summary["failed"], summary["completed"]) == (failed, num - failed)
    assert summary["slo_attainment"] == pytest.approx((num - failed) / num)
    text = (tmp_path / "summary.md").read_text()
    assert f"| HTTP 429 | {expected.count('429')} |" in text
    assert f"| in-stream error | {expected.count('midstream')} |" in text
    for png in ("latency_cdf.png", "goodput_vs_rate.png", "stage_breakdown.png", "handoff.png"):
        assert (tmp_path / png).stat().st_size > 5000


def _load(server: FakeServer, num: int, load: LoadSpec) -> list:
    endpoint = Endpoint(server.url, "fake-model")
    prompts = [PromptSpec((3, 4, 5), 4) for _ in range(num)]
    records, duration = run_load(endpoint, prepare(endpoint, prompts), load)
    assert duration > 0
    return records


def test_closed_loop_keeps_at_most_max_concurrency_in_flight() -> None:
    with serving(FakeServer(lambda n: None, token_delay_s=0.02)) as server:
        records = _load(server, 12, LoadSpec(max_concurrency=3))
        assert server.most_in_flight == 3  # 12 at once, capped: the cap is always full
    assert [r.index for r in records] == list(range(12)) and all(r.ok for r in records)


def test_open_loop_sends_each_request_at_its_arrival_time() -> None:
    load = LoadSpec(request_rate=20.0, seed=1)
    with serving(FakeServer(lambda n: None)) as server:
        records = _load(server, 10, load)
    assert [r.scheduled_s for r in records] == arrival_times(10, 20.0, 1.0, seed=1)
    assert all(r.sent_s >= r.scheduled_s for r in records)  # never early


def test_given_arrival_times_replace_the_rate_and_must_match_the_requests() -> None:
    times = [0.0, 0.05, 0.02, 0.3]  # two arrival processes merged: not sorted
    endpoint_prompts = [PromptSpec((5, 6, 7), 2) for _ in times]
    with serving(FakeServer(lambda n: None)) as server:
        endpoint = Endpoint(server.url, "fake")
        requests = prepare(endpoint, endpoint_prompts)
        records, _ = run_load(endpoint, requests, LoadSpec(request_rate=1.0), times=times)
        with pytest.raises(ValueError, match="3 arrival times for 4 requests"):
            run_load(endpoint, requests, LoadSpec(), times=times[:3])
    assert [r.scheduled_s for r in records] == times
    assert all(r.ok and r.sent_s >= r.scheduled_s for r in records)
