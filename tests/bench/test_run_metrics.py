"""The metric math against examples worked out by hand: TTFT, TPOT, ITL, E2E percentiles,
throughput and goodput under one or several SLOs (times are binary-exact, so bounds compare
exactly)."""

from __future__ import annotations

import math

import pytest

from pdserve.bench.metrics import percentile, summarize
from pdserve.bench.records import RequestRecord
from pdserve.bench.slo import SLO, SLOError, parse_goodput

# A: 5 tokens, first at 125 ms, then one every 125 ms -> TPOT 125 ms, ITL 4 x 125 ms.
A = RequestRecord(0, True, 10, 5, ttft_s=0.125, e2e_s=0.625,
                  chunk_times_s=(0.125, 0.25, 0.375, 0.5, 0.625))
# B: 3 tokens, first at 375 ms, then two 500 ms gaps -> TPOT 500 ms.
B = RequestRecord(1, True, 10, 3, ttft_s=0.375, e2e_s=1.375, chunk_times_s=(0.375, 0.875, 1.375))
# C: one token at 250 ms -> no TPOT sample, TPOT 0 for goodput.
C = RequestRecord(2, True, 10, 1, ttft_s=0.25, e2e_s=0.25, chunk_times_s=(0.25,))
D = RequestRecord(3, False, 10, error="HTTP 500")
RUN = [A, B, C, D]


def test_per_request_tpot_and_itl() -> None:
    assert A.tpot_s == 0.125 and B.tpot_s == 0.5 and C.tpot_s == 0.0 and D.tpot_s is None
    assert A.itl_s == (0.125,) * 4 and B.itl_s == (0.5, 0.5) and C.itl_s == ()


def test_percentiles_interpolate_between_order_statistics() -> None:
    assert percentile([125, 375, 250], 50) == 250
    assert percentile([125, 375, 250], 90) == pytest.approx(350)  # rank 1.8: 250 + 0.8 x 125
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_summary_of_a_run_with_a_failure() -> None:
    s = summarize(RUN, duration_s=2.0, slo=SLO())
    assert (s.num_requests, s.completed, s.failed, s.errors) == (4, 3, 1, {"HTTP 500": 1})
    assert s.request_throughput == 1.5
    assert s.total_output_tokens == 9 and s.output_throughput == 4.5
    assert s.total_input_tokens == 30 and s.total_token_throughput == 19.5
    assert (s.ttft.mean_ms, s.ttft.p50_ms) == (250, 250)
    assert s.ttft.p90_ms == pytest.approx(350) and s.ttft.p99_ms == pytest.approx(372.5)
    # TPOT over answers of 2+ tokens only: [125, 500].
    assert (s.tpot.count, s.tpot.mean_ms, s.tpot.p50_ms) == (2, 312.5, 312.5)
    assert s.tpot.p90_ms == pytest.approx(462.5) and s.tpot.p99_ms == pytest.approx(496.25)
    # ITL pools every gap: [125] x 4 + [500] x 2.
    assert (s.itl.count, s.itl.mean_ms, s.itl.p50_ms, s.itl.p90_ms) == (6, 250, 125, 500)
    assert (s.e2el.mean_ms, s.e2el.p50_ms) == (750, 625)
    assert s.request_goodput is None and s.slo_attainment is None


@pytest.mark.parametrize(("terms", "good"), [
    (["ttft:250"], 2),                          # A, C (250 <= 250)
    (["tpot:125"], 2),                          # A (125 <= 125), C (one token: TPOT 0)
    (["ttft:250", "tpot:100"], 1),              # C only: A's TPOT is 125
    (["e2el:625"], 2),                          # A, C
    (["e2el:600"], 1),                          # C
    (["ttft:200", "e2el:1400"], 1),             # A: B's TTFT 375, C's 250 miss
    (["ttft:400", "tpot:500", "e2el:1400"], 3),  # all that succeeded; D never counts
])
def test_goodput_counts_requests_meeting_every_bound(terms: list[str], good: int) -> None:
    s = summarize(RUN, duration_s=2.0, slo=parse_goodput(terms))
    assert s.num_good == good
    assert s.request_goodput == good / 2.0
    assert s.slo_attainment == good / 4  # the failed request counts as a miss


def test_goodput_terms_parse_like_vllm() -> None:
    slo = parse_goodput(["ttft:500", "tpot:50", "e2el:2000.5"])
    assert slo == SLO(500.0, 50.0, 2000.5)
    assert parse_goodput(slo.to_args()) == slo
    assert slo.describe() == "ttft <= 500 ms, tpot <= 50 ms, e2el <= 2000.5 ms"
    assert parse_goodput(None).is_empty
    for bad, words in ((["itl:5"], "NAME one of"), (["ttft=5"], "NAME:MS"),
                       (["ttft:fast"], "not a number"), (["ttft:0"], "positive"),
                       (["ttft:5", "ttft:6"], "twice")):
        with pytest.raises(SLOError, match=words):
            parse_goodput(bad)
