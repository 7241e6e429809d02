"""Request timings records, their log line, and the Prometheus metrics they feed.

The rendered text is parsed back with prometheus_client's own parser.
"""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.router.metrics import PdserveMetrics
from pdserve.router.roles import ReplicaLoad
from pdserve.router.timings import RequestTimings, time_per_output_token_ms

HISTOGRAMS = ["pdserve:time_to_first_token_seconds",
              "pdserve:request_time_per_output_token_seconds",
              "pdserve:e2e_request_latency_seconds",
              "pdserve:tokenize_seconds", "pdserve:decode_reserve_seconds",
              "pdserve:prefill_queue_seconds", "pdserve:prefill_compute_seconds",
              "pdserve:handoff_seconds", "pdserve:handoff_exposed_seconds", "pdserve:handoff_bytes"]


def disaggregated(request_id: str = "r1", **changes: object) -> RequestTimings:
    timings = RequestTimings(
        request_id, path="disaggregated", finish_reason="stop", num_prompt_tokens=100,
        num_output_tokens=11, prefix_hit_tokens=64, tokenize_ms=1.5, decode_reserve_ms=0.4,
        prefill_queue_ms=2.0, prefill_compute_ms=40.0, handoff_bytes=3 << 20, handoff_ms=12.0,
        handoff_exposed_ms=1.25, ttft_ms=45.0, tpot_ms=8.0, e2e_ms=125.0)
    return timings.with_(**changes)


def samples(metrics: PdserveMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return samples_of(metrics.render())


def test_log_line_is_one_json_object_with_every_field() -> None:
    line = disaggregated(handoff_ms=12.3456789).to_log_line()
    assert "\n" not in line
    record = json.loads(line)
    assert record["event"] == "pdserve.request" and record["request_id"] == "r1"
    assert record["handoff_ms"] == 12.346
    assert record["prefill_tokens_computed"] == 36
    assert record["fallback_reason"] is None
    assert set(record) >= {"tokenize_ms", "decode_reserve_ms", "prefill_queue_ms",
                           "prefix_hit_tokens", "prefill_compute_ms", "handoff_bytes",
                           "handoff_ms", "handoff_exposed_ms", "ttft_ms", "tpot_ms",
                           "num_prompt_tokens", "num_output_tokens", "path", "finish_reason"}


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"path": "sideways"}, "path must be one of"),
    ({"status": "meh"}, "status must be one of"),
    ({"ttft_ms": -1.0}, "ttft_ms must be a finite number >= 0"),
    ({"handoff_ms": float("nan")}, "handoff_ms must be a finite number"),
    ({"prefix_hit_tokens": 101}, "exceeds num_prompt_tokens"),
])
def test_timings_refuse_impossible_values(changes: dict[str, object], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        disaggregated(**changes)


def test_time_per_output_token() -> None:
    assert time_per_output_token_ms(10.0, 10.5, 11) == pytest.approx(50.0)
    assert time_per_output_token_ms(10.0, 10.0, 1) is None


def test_render_holds_every_stage_histogram_after_observe() -> None:
    metrics = PdserveMetrics()
    metrics.observe(disaggregated())
    text = metrics.render().decode()
    for name in HISTOGRAMS:
        assert f"# TYPE {name} histogram" in text, name
    found = samples(metrics)
    path = (("path", "disaggregated"),)
    assert found[("pdserve:time_to_first_token_seconds_count", path)] == 1
    assert found[("pdserve:time_to_first_token_seconds_sum", path)] == pytest.approx(0.045)
    assert found[("pdserve:handoff_exposed_seconds_sum", ())] == pytest.approx(0.00125)
    assert found[("pdserve:handoff_bytes_sum", ())] == 3 << 20
    assert found[("pdserve:prefix_hit_tokens_total", ())] == 64
    assert found[("pdserve:prefill_tokens_computed_total", ())] == 36
    assert found[("pdserve:requests_total", (("path", "disaggregated"), ("status", "ok")))] == 1
    assert metrics.content_type.startswith("text/plain")


def test_counters_accumulate_and_label_paths_statuses_and_fallbacks() -> None:
    metrics = PdserveMetrics()
    metrics.observe(disaggregated("a"))
    metrics.observe(disaggregated("b", prefix_hit_tokens=96))
    metrics.observe(disaggregated("c", path="recompute_fallback", fallback_reason="handoff_timeout",
                                  prefill_tokens_computed=200))
    metrics.observe(RequestTimings("d", status="rejected"))
    found = samples(metrics)
    assert found[("pdserve:prefix_hit_tokens_total", ())] == 64 + 96 + 64
    assert found[("pdserve:prefill_tokens_computed_total", ())] == 36 + 4 + 200
    assert found[("pdserve:fallbacks_total", (("reason", "handoff_timeout"),))] == 1
    assert found[("pdserve:requests_total", (("path", "none"), ("status", "rejected")))] == 1
    assert found[("pdserve:time_to_first_token_seconds_count", (("path", "disaggregated"),))] == 2
    assert found[("pdserve:time_to_first_token_seconds_count",
                  (("path", "recompute_fallback"),))] == 1
    # The rejected request measured no stage: no histogram moved for it.
    assert found[("pdserve:tokenize_seconds_count", ())] == 3


def test_instances_do_not_share_a_registry() -> None:
    first, second = PdserveMetrics(), PdserveMetrics()  # no "Duplicated timeseries" error
    first.observe(disaggregated())
    assert samples(second)[("pdserve:prompt_tokens_total", ())] == 0
    assert samples(first)[("pdserve:prompt_tokens_total", ())] == 100


def test_role_gauges_follow_the_latest_loads_and_forget_gone_replicas() -> None:
    metrics = PdserveMetrics()
    loads = [ReplicaLoad(role="decode", replica_id="d1", num_blocks=200, num_free_blocks=150,
                         num_running=3, num_waiting=1),
             ReplicaLoad(role="prefill", replica_id="p1", num_blocks=100, num_free_blocks=100,
                         num_running=0, num_waiting=2)]
    found = samples_of(metrics.render(loads, num_in_flight=5))
    d1, p1 = (("replica", "d1"), ("role", "decode")), (("replica", "p1"), ("role", "prefill"))
    assert found[("pdserve:kv_cache_usage_perc", d1)] == pytest.approx(0.25)
    assert found[("pdserve:kv_cache_usage_perc", p1)] == 0.0
    assert found[("pdserve:num_requests_running", d1)] == 3
    assert found[("pdserve:num_requests_waiting", p1)] == 2
    assert found[("pdserve:num_requests_in_flight", ())] == 5
    later = samples_of(metrics.render(loads[:1]))
    assert ("pdserve:kv_cache_usage_perc", p1) not in later  # p1 stopped reporting


def test_handoff_failures_count_by_reason_and_token_gaps_fill_the_itl_histogram() -> None:
    metrics = PdserveMetrics()
    metrics.observe(disaggregated("a", path="recompute_fallback", fallback_reason="handoff_failed",
                                  handoff_error="timeout"))
    metrics.observe_token_gaps("disaggregated", [0.01, 0.02, 0.02])
    found = samples(metrics)
    assert found[("pdserve:handoff_failures_total", (("reason", "timeout"),))] == 1
    itl = (("path", "disaggregated"),)
    assert found[("pdserve:inter_token_latency_seconds_count", itl)] == 3
    assert found[("pdserve:inter_token_latency_seconds_sum", itl)] == pytest.approx(0.05)


def samples_of(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text.decode())
            for sample in family.samples}


def test_tier_reuse_goes_to_the_log_line_and_per_tier_metrics() -> None:
    from pdserve.engine.tiers.cost import KVReuse, LoadDecision
    from pdserve.router.timings import reuse_fields

    loaded = KVReuse(num_device_tokens=16, decision=LoadDecision("host", 48, 98304, 0.002, 0.05),
                     num_loaded_tokens=48, load_s=0.003)
    assert KVReuse.from_wire(loaded.to_wire()) == loaded
    computed = KVReuse(num_device_tokens=0, decision=LoadDecision("host", 16, 32768, 0.5, 0.01))
    failed = KVReuse(decision=LoadDecision("host", 32, 65536, 0.001, 0.03), failure="digest")
    metrics = PdserveMetrics()
    first = disaggregated("a", prefix_hit_tokens=64, **reuse_fields(loaded))
    record = json.loads(first.to_log_line())
    assert (record["kv_tier"], record["kv_load_choice"], record["kv_loaded_tokens"]) == (
        "host", "load", 48)
    assert record["kv_load_estimate_ms"] == 2.0 and record["kv_compute_estimate_ms"] == 50.0
    metrics.observe(first)
    metrics.observe(disaggregated("b", prefix_hit_tokens=0, **reuse_fields(computed)))
    metrics.observe(disaggregated("c", prefix_hit_tokens=0, **reuse_fields(failed)))
    got = samples(metrics)
    assert got[("pdserve:prefix_cache_hits_total", (("tier", "host"),))] == 48
    assert got[("pdserve:prefix_cache_hits_total", (("tier", "device"),))] == 16
    assert got[("pdserve:prefix_cache_queries_total", ())] == 300
    assert got[("pdserve:kv_load_decisions_total", (("choice", "load"), ("tier", "host")))] == 2
    assert got[("pdserve:kv_load_decisions_total",
                (("choice", "recompute"), ("tier", "host")))] == 1
    assert got[("pdserve:kv_load_failures_total", (("reason", "digest"), ("tier", "host")))] == 1
    assert got[("pdserve:kv_load_bytes_total", (("tier", "host"),))] == 98304
    assert got[("pdserve:kv_load_seconds_count", (("tier", "host"),))] == 1
