"""Request timings records, their log line, and the Prometheus metrics they feed.

The rendered text is parsed back with prometheus_client's own parser.
"""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.router.metrics import PdserveMetrics
from pdserve.router.timings import RequestTimings, time_per_output_token_ms

HISTOGRAMS = ["pdserve:ttft_seconds", "pdserve:tpot_seconds", "pdserve:e2e_seconds",
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
    text = metrics.render().decode()
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


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
    assert found[("pdserve:ttft_seconds_count", path)] == 1
    assert found[("pdserve:ttft_seconds_sum", path)] == pytest.approx(0.045)
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
    assert found[("pdserve:ttft_seconds_count", (("path", "disaggregated"),))] == 2
    assert found[("pdserve:ttft_seconds_count", (("path", "recompute_fallback"),))] == 1
    # The rejected request measured no stage: no histogram moved for it.
    assert found[("pdserve:tokenize_seconds_count", ())] == 3


def test_instances_do_not_share_a_registry() -> None:
    first, second = PdserveMetrics(), PdserveMetrics()  # no "Duplicated timeseries" error
    first.observe(disaggregated())
    assert samples(second)[("pdserve:prompt_tokens_total", ())] == 0
    assert samples(first)[("pdserve:prompt_tokens_total", ())] == 100
