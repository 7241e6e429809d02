"""P:D planning from single-role profiles, DistServe's way: each role's per-replica goodput at
its own SLO, then as many replicas of each as the target rate needs. Pure arithmetic.

Rule, stated once (every step is printed by `Plan.explain`):
  1. A role profile is a sweep of request rates against ONE replica of that role, each with
     its SLO attainment (prefill: TTFT, decode: TPOT). The replica *sustains* the highest rate
     of the sweep that met the attainment target (DistServe's per-instance goodput); ``g_p``
     and ``g_d`` requests/s. A lower rate that missed is flagged (a noisy measurement).
  2. For a target rate ``R``: ``p = ceil(R / g_p)`` prefill and ``d = ceil(R / g_d)`` decode
     replicas; they cost ``p * c_p + d * c_d`` of the divided resource (CPUs or GPUs).
  3. Given a resource total ``T`` and no target: the ``(p, d)`` with ``p * c_p + d * c_d <= T``
     that sustains the most, ``min(p * g_p, d * g_d)`` (ties: fewer resources, then more decode).
     Given both, step 2 must fit ``T``; otherwise the plan says what ``T`` sustains instead.
  4. The ratio written to ``roles.capacity`` is ``p:d`` and the total is exactly their cost,
     so pdserve's capacity rule (``cluster/capacity.py``) derives the same counts back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import Any, Literal

PlanRole = Literal["prefill", "decode"]
ROLE_METRIC: dict[str, str] = {"prefill": "ttft", "decode": "tpot"}


class PlanError(ValueError):
    """Profiles or targets that admit no plan; the message says what to change."""


@dataclass(frozen=True)
class ProfilePoint:
    """One rate of a role's sweep and the share of its requests that met the role's SLO."""

    request_rate: float
    attainment: float
    num_requests: int = 0


@dataclass(frozen=True)
class RoleProfile:
    """What ONE replica of a role achieved across a sweep of request rates."""

    role: PlanRole
    slo_ms: float  # prefill: TTFT bound; decode: TPOT bound
    attainment_target: float  # e.g. 0.9: 90 % of requests within the SLO
    points: tuple[ProfilePoint, ...]
    workload: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.attainment_target <= 1:
            raise PlanError(f"attainment target must lie in (0, 1], got {self.attainment_target}")
        if not self.points:
            raise PlanError(f"the {self.role} profile has no measured rates")

    @property
    def metric(self) -> str:
        return ROLE_METRIC[self.role]

    @property
    def sustained_rate(self) -> float:
        """Highest swept rate that met the attainment target; 0 if none did."""
        return max((p.request_rate for p in self.points
                    if p.attainment >= self.attainment_target), default=0.0)

    @property
    def dips(self) -> tuple[float, ...]:
        """Rates below the sustained one that missed the target (noise, or a bad sweep)."""
        return tuple(sorted(p.request_rate for p in self.points
                            if p.request_rate < self.sustained_rate
                            and p.attainment < self.attainment_target))

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "points": [asdict(p) for p in self.points],
                "sustained_rate": self.sustained_rate}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RoleProfile:
        return cls(role=data["role"], slo_ms=data["slo_ms"],
                   attainment_target=data["attainment_target"],
                   points=tuple(ProfilePoint(**p) for p in data["points"]),
                   workload=data.get("workload", {}))


@dataclass(frozen=True)
class Plan:
    """Replica counts per role and the arithmetic that chose them."""

    prefill_replicas: int
    decode_replicas: int
    prefill_rate: float  # g_p: requests/s one prefill replica sustains
    decode_rate: float  # g_d
    resource: Literal["CPU", "GPU"]
    prefill_cost: float  # c_p: resource per prefill replica
    decode_cost: float
    target_rate: float | None
    total: float | None
    lines: tuple[str, ...]  # the arithmetic, one step per line

    @property
    def cost(self) -> float:
        return self.prefill_replicas * self.prefill_cost + self.decode_replicas * self.decode_cost

    @property
    def sustained_rate(self) -> float:
        return min(self.prefill_replicas * self.prefill_rate,
                   self.decode_replicas * self.decode_rate)

    @property
    def ratio(self) -> str:
        divisor = math.gcd(self.prefill_replicas, self.decode_replicas)
        return f"{self.prefill_replicas // divisor}:{self.decode_replicas // divisor}"

    def capacity_fragment(self) -> dict[str, Any]:
        """The ``roles.capacity`` mapping that derives exactly these replica counts."""
        key = "total_gpus" if self.resource == "GPU" else "total_cpus"
        total = self.cost
        return {"roles": {"capacity": {"ratio": self.ratio,
                                       key: int(total) if total == int(total) else total}}}

    def explain(self) -> str:
        return "\n".join(self.lines)


def _g(value: float) -> str:
    return f"{value:g}"


def make_plan(prefill: RoleProfile, decode: RoleProfile, *, target_rate: float | None = None,
              total: float | None = None, resource: Literal["CPU", "GPU"] = "CPU",
              prefill_cost: float = 1.0, decode_cost: float = 1.0) -> Plan:
    """Replica counts for a target rate and/or a resource total (rule in the module doc)."""
    if prefill.role != "prefill" or decode.role != "decode":
        raise PlanError("make_plan takes a prefill profile, then a decode profile")
    if target_rate is None and total is None:
        raise PlanError("give a target rate (--target-rate), a resource total (--total), or both")
    if target_rate is not None and not target_rate > 0:
        raise PlanError(f"--target-rate must be > 0, got {target_rate}")
    if prefill_cost <= 0 or decode_cost <= 0:
        raise PlanError("each replica must cost a positive amount of the divided resource")
    g_p, g_d = prefill.sustained_rate, decode.sustained_rate
    lines = [_profile_line(prefill), _profile_line(decode)]
    for profile, rate in ((prefill, g_p), (decode, g_d)):
        if rate <= 0:
            raise PlanError(f"one {profile.role} replica met the {profile.metric.upper()} SLO "
                            f"at none of the profiled rates (lowest "
                            f"{min(p.request_rate for p in profile.points):g} req/s); profile "
                            "lower rates or relax the SLO")
    unit = f"{resource}s"
    if target_rate is not None:
        p, d = math.ceil(Fraction(str(target_rate)) / Fraction(str(g_p))), \
            math.ceil(Fraction(str(target_rate)) / Fraction(str(g_d)))
        cost = p * prefill_cost + d * decode_cost
        lines += [f"target {_g(target_rate)} req/s: prefill replicas = ceil({_g(target_rate)} / "
                  f"{_g(g_p)}) = {p}, decode replicas = ceil({_g(target_rate)} / {_g(g_d)}) = {d}",
                  f"cost: {p} x {_g(prefill_cost)} + {d} x {_g(decode_cost)} = {_g(cost)} {unit}"]
        if total is not None and cost > total:
            best = _best_within(g_p, g_d, total, prefill_cost, decode_cost)
            best_text = "not even one replica of each" if best is None else (
                f"{best[0]}:{best[1]} sustains {_g(min(best[0] * g_p, best[1] * g_d))} req/s")
            raise PlanError("\n".join(lines) + f"\n{_g(target_rate)} req/s needs {_g(cost)} "
                            f"{unit}, more than the total {_g(total)}; within {_g(total)} "
                            f"{unit}, {best_text}")
        if total is not None:
            lines.append(f"fits the total {_g(total)} {unit} ({_g(total - cost)} left over)")
    else:
        assert total is not None
        best = _best_within(g_p, g_d, total, prefill_cost, decode_cost)
        if best is None:
            raise PlanError(f"{_g(total)} {unit} cannot hold one prefill ({_g(prefill_cost)}) "
                            f"and one decode ({_g(decode_cost)}) replica")
        p, d = best
        lines.append(f"within {_g(total)} {unit}: of every (p, d) with p x {_g(prefill_cost)} + "
                     f"d x {_g(decode_cost)} <= {_g(total)}, p={p}, d={d} sustains the most: "
                     f"min({p} x {_g(g_p)}, {d} x {_g(g_d)}) = {_g(min(p * g_p, d * g_d))} req/s")
    sustained = min(p * g_p, d * g_d)
    bottleneck = ("balanced" if p * g_p == d * g_d else
                  "prefill-bound" if p * g_p < d * g_d else "decode-bound")
    divisor = math.gcd(p, d)
    lines.append(f"plan: {p} prefill + {d} decode replicas (ratio {p // divisor}:{d // divisor}), "
                 f"sustains min({p} x {_g(g_p)}, {d} x {_g(g_d)}) = {_g(sustained)} req/s "
                 f"({bottleneck})")
    return Plan(p, d, g_p, g_d, resource, prefill_cost, decode_cost, target_rate, total,
                tuple(lines))


def _profile_line(profile: RoleProfile) -> str:
    tested = ", ".join(f"{p.request_rate:g}/s: {p.attainment:.0%}" for p in
                       sorted(profile.points, key=lambda p: p.request_rate))
    top = max(p.request_rate for p in profile.points)
    bound = (" - every profiled rate passed, so this is a lower bound: profile higher rates"
             if profile.sustained_rate == top and not profile.dips else "")
    if profile.dips:
        bound += (f" - note: {', '.join(f'{r:g}' for r in profile.dips)} req/s missed although "
                  "a higher rate passed (a noisy machine?); rerun with more prompts")
    return (f"{profile.role}: one replica sustains {_g(profile.sustained_rate)} req/s at "
            f"{profile.metric.upper()} <= {profile.slo_ms:g} ms for "
            f"{profile.attainment_target:.0%} of requests (attainment by rate: {tested}){bound}")


def _best_within(g_p: float, g_d: float, total: float, c_p: float,
                 c_d: float) -> tuple[int, int] | None:
    best: tuple[float, float, int, int] | None = None
    for p in range(1, int(total // c_p) + 1):
        d = int((total - p * c_p) // c_d)
        for dd in range(1, d + 1):
            # Key: sustained rate (max), then cost (min), then decode replicas (max).
            key = (min(p * g_p, dd * g_d), -(p * c_p + dd * c_d), dd, p)
            if best is None or key > best:
                best = key
    return None if best is None else (int(best[3]), int(best[2]))


def profiles_from_json(data: Mapping[str, Any]) -> tuple[RoleProfile, RoleProfile]:
    """The (prefill, decode) profiles of a saved profile file."""
    by_role = {p["role"]: RoleProfile.from_json(p) for p in data["profiles"]}
    missing = {"prefill", "decode"} - set(by_role)
    if missing:
        raise PlanError(f"the profile file lacks the {' and '.join(sorted(missing))} profile; "
                        "run `pdserve plan --profile CONFIG` to make both")
    return by_role["prefill"], by_role["decode"]
