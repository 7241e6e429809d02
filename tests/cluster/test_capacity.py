"""Ratio arithmetic: parsing, replica derivation, cluster fit, the autoscaling ratio band.

Pure functions; exhaustive checks over small ranges stand in for property tests.
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from pdserve.cluster.capacity import (
    CapacityError,
    RatioBand,
    RatioTerms,
    ReplicaResources,
    check_fits_cluster,
    check_ratio_band,
    clamp_to_band,
    derive_replicas,
    derive_single_role,
    parse_ratio,
)

ONE_CPU = ReplicaResources(num_cpus=1)
ONE_GPU = ReplicaResources(num_cpus=4, num_gpus=1)


@pytest.mark.parametrize(("text", "expected"), [
    ("1:2", (1, 2)), (" 3 : 1 ", (3, 1)), ("2:4", (1, 2)), ({"prefill": 2, "decode": 6}, (1, 3)),
    ("4.0:2", (2, 1)),
])
def test_parse_ratio_reduces_by_gcd(text: object, expected: tuple[int, int]) -> None:
    ratio = parse_ratio(text)  # type: ignore[arg-type]
    assert (ratio.prefill, ratio.decode) == expected


@pytest.mark.parametrize(("text", "fragment"), [
    ("0:2", "positive integers"), ("-1:2", "positive integers"), ("1:0", "positive integers"),
    ("1.5:3", "positive integers"), ("1-2", "form 'P:D'"), ("one:two", "form 'P:D'"),
    ({"prefill": 1}, "exactly the keys"), ({"prefill": 0, "decode": 1}, "positive integers"),
    ({"prefill": True, "decode": 1}, "must be 'P:D'"), (3, "must be 'P:D'"),
])
def test_parse_ratio_refuses_bad_terms(text: object, fragment: str) -> None:
    with pytest.raises(CapacityError, match=fragment) as info:
        parse_ratio(text)  # type: ignore[arg-type]
    assert info.value.key == "ratio"


def test_derive_replicas_divides_total_by_ratio_units() -> None:
    plan = derive_replicas(parse_ratio("1:2"), 3, "CPU", ONE_CPU, ONE_CPU)
    assert [(r.role, r.replicas) for r in plan.roles] == [("prefill", 1), ("decode", 2)]
    assert plan.summary() == ("prefill: 1 replica x 1 CPU, decode: 2 replicas x 1 CPU "
                              "(ratio 1:2 of 3 CPUs)")
    plan = derive_replicas(parse_ratio("1:2"), 12, "GPU", ONE_GPU, ONE_GPU)
    assert (plan.role("prefill").replicas, plan.role("decode").replicas) == (4, 8)  # type: ignore[union-attr]
    assert plan.demand() == {"GPU": 12, "CPU": 48}


def test_derive_replicas_with_unequal_per_replica_cost() -> None:
    # A unit of 1 prefill (2 GPUs) + 3 decode (1 GPU) costs 5 GPUs; 10 GPUs hold 2 units.
    plan = derive_replicas(parse_ratio("1:3"), 10, "GPU", ReplicaResources(num_gpus=2),
                           ReplicaResources(num_gpus=1))
    assert [r.replicas for r in plan.roles] == [2, 6]
    assert "2 replicas x 2 GPUs" in plan.summary()


def test_derive_replicas_matches_brute_force_over_small_ranges() -> None:
    for p in range(1, 4):
        for d in range(1, 4):
            for total in range(1, 13):
                ratio = RatioTerms(p, d)
                fits = [k for k in range(1, 13) if k * (ratio.prefill + ratio.decode) == total]
                try:
                    plan = derive_replicas(ratio, total, "CPU", ONE_CPU, ONE_CPU)
                except CapacityError:
                    assert not fits, (p, d, total)
                    continue
                k = fits[0]
                assert [r.replicas for r in plan.roles] == [k * ratio.prefill, k * ratio.decode]
                assert plan.role("prefill").replicas * ratio.decode == \
                    plan.role("decode").replicas * ratio.prefill  # type: ignore[union-attr]


def test_total_too_small_for_one_unit_is_refused_with_the_needed_amount() -> None:
    with pytest.raises(CapacityError,
                       match=r"cannot hold one ratio unit 1:2.*raise total_gpus to 3"):
        derive_replicas(parse_ratio("1:2"), 2, "GPU", ONE_GPU, ONE_GPU)


def test_fractional_replicas_are_refused_with_the_nearest_valid_totals() -> None:
    with pytest.raises(CapacityError, match=r"fractional replicas; use 3 or 6") as info:
        derive_replicas(parse_ratio("1:2"), 4, "CPU", ONE_CPU, ONE_CPU)
    assert info.value.key == "capacity.total_cpus"


def test_allow_unused_keeps_the_remainder_idle_and_says_so() -> None:
    plan = derive_replicas(parse_ratio("1:2"), 4, "CPU", ONE_CPU, ONE_CPU, allow_unused=True)
    assert [r.replicas for r in plan.roles] == [1, 2]
    assert plan.unused == 1
    assert plan.summary().endswith("(ratio 1:2 of 4 CPUs, 1 CPU unused)")


def test_decimal_amounts_are_exact() -> None:
    # 0.1 + 0.2 is not 0.3 in binary floats; the arithmetic must not refuse this.
    plan = derive_replicas(parse_ratio("1:2"), 0.3, "CPU", ReplicaResources(num_cpus=0.1),
                           ReplicaResources(num_cpus=0.1))
    assert [r.replicas for r in plan.roles] == [1, 2]
    assert "x 0.1 CPU" in plan.summary()


def test_dividing_a_resource_a_role_does_not_use_is_refused() -> None:
    with pytest.raises(CapacityError, match="asks for 0 GPU") as info:
        derive_replicas(parse_ratio("1:1"), 4, "GPU", ONE_CPU, ONE_GPU)
    assert info.value.key == "prefill.resources.num_gpus"


def test_single_role_fills_the_total() -> None:
    plan = derive_single_role("decode", 3, "CPU", ONE_CPU)
    assert [r.replicas for r in plan.roles] == [3]
    assert plan.summary() == "decode: 3 replicas x 1 CPU (of 3 CPUs)"
    with pytest.raises(CapacityError, match="not a whole number"):
        derive_single_role("decode", 3, "CPU", ReplicaResources(num_cpus=2))


def test_cluster_fit_counts_cpus_gpus_and_custom_resources() -> None:
    pinned = ReplicaResources(num_cpus=1, custom=(("pd_prefill", 1.0),))
    plan = derive_replicas(parse_ratio("1:2"), 3, "CPU", pinned, ONE_CPU)
    check_fits_cluster(plan, {"CPU": 3.0, "pd_prefill": 1.0, "memory": 1e9})
    with pytest.raises(CapacityError, match=r"need 3 CPU in all .* cluster has 2"):
        check_fits_cluster(plan, {"CPU": 2.0, "pd_prefill": 1.0})
    with pytest.raises(CapacityError, match="no node in the cluster has it"):
        check_fits_cluster(plan, {"CPU": 8.0})
    with pytest.raises(CapacityError, match=r"need 3.5 CPU"):
        check_fits_cluster(plan, {"CPU": 3.0, "pd_prefill": 1.0}, extra_demand={"CPU": 0.5})


def test_cluster_without_gpus_refuses_gpu_replicas() -> None:
    plan = derive_replicas(parse_ratio("1:1"), 2, "GPU", ONE_GPU, ONE_GPU)
    with pytest.raises(CapacityError, match=r"need 2 GPU in all"):
        check_fits_cluster(plan, {"CPU": 16.0})


def test_ratio_band_membership_is_exact() -> None:
    band = RatioBand.from_ratios(parse_ratio("1:4"), parse_ratio("1:1"))
    assert check_ratio_band(1, 4, band) and check_ratio_band(2, 2, band)
    assert check_ratio_band(1, 3, band)
    assert not check_ratio_band(1, 5, band)
    assert not check_ratio_band(3, 2, band)
    assert not check_ratio_band(0, 2, band)
    with pytest.raises(CapacityError):
        RatioBand(Fraction(1), Fraction(1, 2))


def test_clamp_to_band_never_leaves_the_band_or_bounds() -> None:
    band = RatioBand.from_ratios(parse_ratio("1:4"), parse_ratio("1:1"))
    for prefill in range(1, 6):
        for decode in range(1, 11):
            for proposed in range(14):
                for role in ("prefill", "decode"):
                    got = clamp_to_band(role, proposed, prefill, decode, band,  # type: ignore[arg-type]
                                        1, 10)
                    current = prefill if role == "prefill" else decode
                    p, d = (got, decode) if role == "prefill" else (prefill, got)
                    if got != current:
                        assert check_ratio_band(p, d, band) and 1 <= got <= 10
                    if check_ratio_band(p, d, band) and 1 <= proposed <= 10:
                        # Feasible proposals are granted exactly.
                        pp, dd = (proposed, decode) if role == "prefill" else (prefill, proposed)
                        if check_ratio_band(pp, dd, band):
                            assert got == proposed


def test_clamp_examples() -> None:
    band = RatioBand.from_ratios(parse_ratio("1:4"), parse_ratio("1:2"))
    # Decode wants 12 with 2 prefill: at most 8 keeps 1:4.
    assert clamp_to_band("decode", 12, 2, 4, band, 1, 16) == 8
    # Decode wants 1 with 2 prefill: at least 4 keeps 1:2.
    assert clamp_to_band("decode", 1, 2, 6, band, 1, 16) == 4
    # max_replicas binds before the band does.
    assert clamp_to_band("decode", 12, 2, 4, band, 1, 6) == 6
    # 3 prefill need >= 6 decode but max is 5: no decode count helps, so no change.
    assert clamp_to_band("decode", 5, 3, 5, band, 1, 5) == 5
