"""The planner's arithmetic on profiles whose answers are worked out by hand, and its YAML
fragment derived back by pdserve's own capacity rule."""

from __future__ import annotations

import pytest

from pdserve.bench.planner import (
    PlanError,
    ProfilePoint,
    RoleProfile,
    make_plan,
    profiles_from_json,
)
from pdserve.cluster.capacity import ReplicaResources, derive_replicas, parse_ratio


def profile(role: str, slo_ms: float, points: dict[float, float]) -> RoleProfile:
    return RoleProfile(role, slo_ms, 0.9, tuple(ProfilePoint(r, a, 20) for r, a in points.items()))


# One prefill replica holds 90 % TTFT attainment up to 2 req/s, one decode replica up to 4.
PREFILL = profile("prefill", 1000, {1: 1.0, 2: 0.95, 3: 0.8, 4: 0.5})
DECODE = profile("decode", 50, {1: 1.0, 2: 1.0, 4: 0.92, 6: 0.85})


def test_sustained_rate_is_the_highest_rate_meeting_the_target() -> None:
    assert PREFILL.sustained_rate == 2 and DECODE.sustained_rate == 4
    dip = profile("prefill", 1000, {1: 0.85, 2: 0.7, 3: 0.96, 4: 0.5})
    assert dip.sustained_rate == 3 and dip.dips == (1, 2)
    text = make_plan(dip, DECODE, total=2).explain()
    assert "note: 1, 2 req/s missed although a higher rate passed" in text


def test_target_rate_gives_ceil_of_rate_over_per_replica_goodput() -> None:
    plan = make_plan(PREFILL, DECODE, target_rate=10)
    # ceil(10 / 2) = 5 prefill, ceil(10 / 4) = 3 decode; 8 CPUs; min(5 x 2, 3 x 4) = 10 req/s.
    assert (plan.prefill_replicas, plan.decode_replicas, plan.cost) == (5, 3, 8)
    assert plan.ratio == "5:3" and plan.sustained_rate == 10
    text = plan.explain()
    assert "ceil(10 / 2) = 5" in text and "ceil(10 / 4) = 3" in text
    assert "5 x 1 + 3 x 1 = 8 CPUs" in text and "prefill-bound" in text
    assert "lower bound" not in text  # both profiles found a rate their replica misses
    passing = profile("decode", 50, {1: 1.0, 2: 0.95})
    assert "lower bound: profile higher rates" in make_plan(PREFILL, passing, total=2).explain()


def test_a_total_alone_maximises_what_it_sustains() -> None:
    # p + d <= 6: 4:2 sustains min(8, 8) = 8; 3:3 min(6, 12) = 6; 5:1 min(10, 4) = 4.
    plan = make_plan(PREFILL, DECODE, total=6)
    assert (plan.prefill_replicas, plan.decode_replicas, plan.sustained_rate) == (4, 2, 8)
    assert "= 8 req/s (balanced)" in plan.explain()
    fragment = plan.capacity_fragment()
    assert fragment == {"roles": {"capacity": {"ratio": "2:1", "total_cpus": 6}}}
    # pdserve's capacity rule derives the same counts back from the fragment.
    capacity = fragment["roles"]["capacity"]
    derived = derive_replicas(parse_ratio(capacity["ratio"]), capacity["total_cpus"], "CPU",
                              ReplicaResources(1), ReplicaResources(1))
    assert [r.replicas for r in derived.roles] == [4, 2]


def test_unequal_replica_costs() -> None:
    # Prefill replicas cost 2 GPUs, decode 1: for 4 req/s, ceil(4/2) = 2 x 2 + ceil(4/4) = 1.
    plan = make_plan(PREFILL, DECODE, target_rate=4, resource="GPU", prefill_cost=2)
    assert (plan.prefill_replicas, plan.decode_replicas, plan.cost) == (2, 1, 5)
    assert plan.capacity_fragment()["roles"]["capacity"] == {"ratio": "2:1", "total_gpus": 5}


def test_a_target_beyond_the_total_is_refused_with_what_fits() -> None:
    with pytest.raises(PlanError, match=r"needs 8 CPUs.*4:2 sustains 8 req/s"):
        make_plan(PREFILL, DECODE, target_rate=10, total=6)
    plan = make_plan(PREFILL, DECODE, target_rate=4, total=6)  # 2 + 1 = 3 CPUs, 3 left over
    assert (plan.prefill_replicas, plan.decode_replicas) == (2, 1)
    assert "3 left over" in plan.explain()


def test_a_role_that_never_meets_its_slo_is_refused() -> None:
    hopeless = profile("decode", 5, {1: 0.2, 2: 0.1})
    with pytest.raises(PlanError, match="none of the profiled rates"):
        make_plan(PREFILL, hopeless, target_rate=1)


def test_profiles_round_trip_through_json() -> None:
    data = {"profiles": [PREFILL.to_json(), DECODE.to_json()]}
    assert profiles_from_json(data) == (PREFILL, DECODE)
    with pytest.raises(PlanError, match="lacks the decode profile"):
        profiles_from_json({"profiles": [PREFILL.to_json()]})


def test_a_replica_costs_every_rank_of_it() -> None:
    from pathlib import Path

    from pdserve.bench.compare import Setup
    from pdserve.bench.profile import replica_cost
    from pdserve.cluster.config import parse_config

    raw = {"model": {"generate": {"family": "llama", "size": "tiny", "seed": 0}},
           "roles": {"prefill": {"replicas": 1, "resources": {"num_cpus": 1.5}},
                     "decode": {"replicas": 1, "tensor_parallel_size": 2,
                                "resources": {"num_cpus": 1.5}}}}
    setup = Setup("tp", Path("tp.yaml"), parse_config(raw, "test"), raw)
    assert replica_cost(setup, "prefill") == ("CPU", 1.5)
    assert replica_cost(setup, "decode") == ("CPU", 3.0)
    raw["roles"]["decode"]["resources"] = {"num_gpus": 1}
    gpu = Setup("tp", Path("tp.yaml"), parse_config(raw, "test"), raw)
    assert replica_cost(gpu, "decode") == ("GPU", 2.0)
