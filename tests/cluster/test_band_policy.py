"""The ratio-band autoscaling policy: the pure step rule, exhaustively, and the Serve adapter
on Serve's own AutoscalingContext records (no Ray started)."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
from ray.serve._private.common import DeploymentID
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from pdserve.cluster.band_policy import RatioBandPolicy, RoleScale, band_step
from pdserve.cluster.capacity import RatioBand, check_ratio_band, parse_ratio

BAND = RatioBand.from_ratios(parse_ratio("1:3"), parse_ratio("1:1"))


def scale(target: int, proposed: int, running: int | None = None, low: int = 1,
          high: int = 6) -> RoleScale:
    return RoleScale(running=target if running is None else running, target=target,
                     proposed=proposed, min_replicas=low, max_replicas=high)


def test_one_role_moves_and_only_inside_the_band() -> None:
    # Decode wants 6 with one prefill: the band allows at most 3.
    assert band_step(scale(1, 1), scale(1, 6), BAND) == (1, 3)
    # Both want more: the larger relative gap goes first, the other waits for the next step.
    assert band_step(scale(1, 2), scale(1, 6), BAND) == (1, 3)
    # Upscales go before downscales.
    assert band_step(scale(2, 1), scale(2, 4), BAND) == (2, 4)
    # Prefill may not drop to 1 while 4 decode replicas need >= 2 prefill (1:3 minimum).
    assert band_step(scale(2, 1), scale(4, 4), BAND) == (2, 4)
    # Nothing moves while a role is still starting or stopping replicas.
    assert band_step(scale(1, 1), scale(2, 3, running=1), BAND) == (1, 2)
    assert band_step(scale(1, 1, running=0), scale(1, 3), BAND) == (1, 1)


def test_every_step_keeps_the_band_for_all_counts_on_the_way() -> None:
    """Exhaustive over small counts: from an in-band settled state, the new targets are in
    the band, one role moves, and every count between its old and new target is in the band."""
    for p, d, wanted_p, wanted_d in itertools.product(range(1, 7), repeat=4):
        if not check_ratio_band(p, d, BAND):
            continue
        new_p, new_d = band_step(scale(p, wanted_p), scale(d, wanted_d), BAND)
        assert check_ratio_band(new_p, new_d, BAND), (p, d, wanted_p, wanted_d)
        assert new_p == p or new_d == d
        for mid_p in range(min(p, new_p), max(p, new_p) + 1):
            for mid_d in range(min(d, new_d), max(d, new_d) + 1):
                assert check_ratio_band(mid_p, mid_d, BAND)
        # A feasible wish of a single role is granted in one step.
        if wanted_p == p and check_ratio_band(p, wanted_d, BAND):
            assert (new_p, new_d) == (p, wanted_d)


def context(name: str, running: int, target: int, ongoing: float, low: int, high: int
            ) -> tuple[DeploymentID, AutoscalingContext]:
    dep_id = DeploymentID(name=name, app_name="pdserve")
    config = AutoscalingConfig(min_replicas=low, max_replicas=high, target_ongoing_requests=2)
    ctx = AutoscalingContext(
        deployment_id=dep_id, deployment_name=name, app_name="pdserve",
        current_num_replicas=running, target_num_replicas=target, running_replicas=[],
        total_num_requests=ongoing, total_queued_requests=0.0, aggregated_metrics={},
        raw_metrics={}, capacity_adjusted_min_replicas=low, capacity_adjusted_max_replicas=high,
        policy_state={}, last_scale_up_time=None, last_scale_down_time=None, current_time=0.0,
        config=config)
    return dep_id, ctx


def test_policy_on_serve_contexts_caps_decode_at_the_band() -> None:
    policy = RatioBandPolicy("1:2", "1:1")
    prefill_id, prefill = context("prefill", 1, 1, ongoing=0, low=1, high=1)
    decode_id, decode = context("decode", 1, 1, ongoing=24, low=1, high=3)
    decisions, state = policy({prefill_id: prefill, decode_id: decode})
    # Load alone asks for 12 decode replicas (24 / 2), max_replicas 3; the band 1:2 allows 2.
    assert decisions == {prefill_id: 1, decode_id: 2}
    assert state is None
    _, idle = context("decode", 2, 2, ongoing=0, low=1, high=3)
    assert policy({prefill_id: prefill, decode_id: idle})[0][decode_id] == 1


def test_policy_without_both_roles_scales_on_load_alone() -> None:
    decode_id, decode = context("decode", 1, 1, ongoing=10, low=1, high=4)
    assert RatioBandPolicy("1:2", "1:1")({decode_id: decode})[0] == {decode_id: 4}


def test_policy_refuses_a_bad_band() -> None:
    with pytest.raises(ValueError, match="positive integers"):
        RatioBandPolicy("0:1", "1:1")
    assert RatioBandPolicy("2:4", "1:1").band.low == Fraction(1, 2)
