"""Capacity-ratio arithmetic: replica counts from a prefill:decode ratio and a resource total.

Pure functions over frozen records; nothing here imports Ray. Exact `Fraction` arithmetic.

Derivation rule (``derive_replicas``), stated once:
  1. The ratio ``p:d`` is reduced by its gcd (``2:4`` means the same as ``1:2``); terms must be
     positive integers.
  2. One *ratio unit* is ``p`` prefill plus ``d`` decode replicas; it costs
     ``u = p * cost_prefill + d * cost_decode`` of the divided resource (CPU or GPU), where a
     role's cost is its per-replica amount of that resource, which must be > 0.
  3. ``k = floor(total / u)`` units fit; ``k < 1`` is refused (not even one replica each).
  4. Replicas are ``k*p`` prefill and ``k*d`` decode. If ``total - k*u > 0`` the total would
     need fractional replicas to honour the ratio exactly: refused unless ``allow_unused``,
     in which case the remainder stays idle and the start-up summary says so.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Literal

RoleName = Literal["prefill", "decode"]
DividedResource = Literal["CPU", "GPU"]

_RATIO_RE = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*:\s*(-?\d+(?:\.\d+)?)\s*$")


class CapacityError(ValueError):
    """Replica counts cannot be derived or do not fit; ``key`` is the config key to change."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(message)


def exact(value: float) -> Fraction:
    """The decimal value as written (0.1 is 1/10, not the nearest binary double)."""
    return Fraction(str(value)) if isinstance(value, float) else Fraction(value)


def format_amount(value: Fraction | float) -> str:
    """``2`` for whole amounts, ``0.5`` otherwise: how people write resource amounts."""
    value = Fraction(value) if not isinstance(value, Fraction) else value
    return str(value.numerator) if value.denominator == 1 else f"{float(value):g}"


@dataclass(frozen=True)
class RatioTerms:
    """A prefill:decode ratio, reduced by its gcd; both terms are positive integers."""

    prefill: int
    decode: int

    def __post_init__(self) -> None:
        if self.prefill <= 0 or self.decode <= 0:
            raise CapacityError(
                "ratio", f"ratio terms must be positive integers, got "
                f"{self.prefill}:{self.decode}; write e.g. '1:2' (one prefill replica per two "
                "decode replicas)")
        divisor = math.gcd(self.prefill, self.decode)
        object.__setattr__(self, "prefill", self.prefill // divisor)
        object.__setattr__(self, "decode", self.decode // divisor)

    @property
    def fraction(self) -> Fraction:
        """Prefill replicas per decode replica."""
        return Fraction(self.prefill, self.decode)

    def __str__(self) -> str:
        return f"{self.prefill}:{self.decode}"


def _as_ratio_term(raw: object, text: object) -> int:
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise CapacityError("ratio", f"ratio {text!r} must be 'P:D' or {{prefill: P, decode: D}}")
    number = Fraction(str(raw))
    if number.denominator != 1 or number <= 0:
        raise CapacityError(
            "ratio", f"ratio terms must be positive integers, got {text!r}; write e.g. '1:2'")
    return int(number)


def parse_ratio(value: str | Mapping[str, object] | RatioTerms) -> RatioTerms:
    """Parse ``"1:2"`` or ``{"prefill": 1, "decode": 2}``; refuse zero, negative or fractional."""
    if isinstance(value, RatioTerms):
        return value
    if isinstance(value, str):
        match = _RATIO_RE.match(value)
        if match is None:
            raise CapacityError("ratio", f"ratio {value!r} is not of the form 'P:D', e.g. '1:2'")
        raw_p, raw_d = match.group(1), match.group(2)
    elif isinstance(value, Mapping):
        if set(value) != {"prefill", "decode"}:
            raise CapacityError("ratio", "ratio mapping needs exactly the keys prefill and "
                                f"decode, got {sorted(value)}")
        raw_p, raw_d = value["prefill"], value["decode"]
    else:
        raise CapacityError("ratio", f"ratio {value!r} must be 'P:D' or {{prefill: P, decode: D}}")
    return RatioTerms(_as_ratio_term(raw_p, value), _as_ratio_term(raw_d, value))


@dataclass(frozen=True)
class ReplicaResources:
    """What one replica asks Ray for: logical CPUs, GPUs and custom resources."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    custom: tuple[tuple[str, float], ...] = ()

    def amount(self, resource: str) -> Fraction:
        """This replica's amount of a Ray resource name (``CPU``, ``GPU`` or a custom name)."""
        if resource == "CPU":
            return exact(self.num_cpus)
        if resource == "GPU":
            return exact(self.num_gpus)
        return sum((exact(v) for k, v in self.custom if k == resource), Fraction(0))

    def resource_names(self) -> list[str]:
        names = [name for name in ("GPU", "CPU") if self.amount(name) > 0]
        return names + [k for k, v in self.custom if v > 0]

    def describe(self) -> str:
        """``1 GPU + 4 CPUs``; ``0 CPU`` when it asks for nothing."""
        parts = []
        for name in self.resource_names():
            amount = self.amount(name)
            plural = "s" if name in ("CPU", "GPU") and amount > 1 else ""
            parts.append(f"{format_amount(amount)} {name}{plural}")
        return " + ".join(parts) or "0 CPU"


@dataclass(frozen=True)
class RolePlan:
    """How many replicas one role starts with, and what each one asks for."""

    role: str
    replicas: int
    resources: ReplicaResources

    def describe(self) -> str:
        noun = "replica" if self.replicas == 1 else "replicas"
        return f"{self.role}: {self.replicas} {noun} x {self.resources.describe()}"


@dataclass(frozen=True)
class ReplicaPlan:
    """The start-up replica counts of every role, and how they were derived."""

    roles: tuple[RolePlan, ...]
    ratio: RatioTerms | None = None
    divided_resource: DividedResource | None = None
    total: Fraction | None = None
    unused: Fraction = field(default=Fraction(0))

    def role(self, name: str) -> RolePlan | None:
        return next((r for r in self.roles if r.role == name), None)

    def demand(self) -> dict[str, Fraction]:
        """Total of every resource the start-up replicas ask for."""
        totals: dict[str, Fraction] = {}
        for plan in self.roles:
            for name in plan.resources.resource_names():
                amount = plan.replicas * plan.resources.amount(name)
                totals[name] = totals.get(name, Fraction(0)) + amount
        return totals

    def summary(self) -> str:
        """One line for the start-up log, e.g.
        ``prefill: 1 replica x 1 CPU, decode: 2 replicas x 1 CPU (ratio 1:2 of 3 CPUs)``."""
        text = ", ".join(plan.describe() for plan in self.roles)
        if self.total is not None and self.divided_resource is not None:
            unit = f"{self.divided_resource}s" if self.total != 1 else self.divided_resource
            note = f"{format_amount(self.total)} {unit}"
            note = f"ratio {self.ratio} of {note}" if self.ratio is not None else f"of {note}"
            if self.unused > 0:
                note += f", {format_amount(self.unused)} {self.divided_resource} unused"
            return f"{text} ({note})"
        if self.ratio is not None:
            return f"{text} (ratio {self.ratio})"
        return text


def derive_replicas(ratio: RatioTerms, total: float, resource: DividedResource,
                    prefill: ReplicaResources, decode: ReplicaResources, *,
                    allow_unused: bool = False) -> ReplicaPlan:
    """Divide ``total`` of ``resource`` by ``ratio`` (rule in the module docstring)."""
    total_exact = exact(total)
    total_key = f"total_{resource.lower()}s"
    for role, res in (("prefill", prefill), ("decode", decode)):
        if res.amount(resource) <= 0:
            raise CapacityError(
                f"{role}.resources.num_{resource.lower()}s",
                f"roles.capacity divides {total_key} but each {role} replica asks for 0 "
                f"{resource}; set roles.{role}.resources.num_{resource.lower()}s > 0 or divide "
                "the other resource")
    unit_cost = ratio.prefill * prefill.amount(resource) + ratio.decode * decode.amount(resource)
    units = math.floor(total_exact / unit_cost)
    unit_text = (f"{ratio.prefill} x {format_amount(prefill.amount(resource))} + "
                 f"{ratio.decode} x {format_amount(decode.amount(resource))} = "
                 f"{format_amount(unit_cost)} {resource}")
    if units < 1:
        raise CapacityError(
            f"capacity.{total_key}", f"{total_key}={format_amount(total_exact)} cannot hold "
            f"one ratio unit {ratio} ({unit_text}); raise {total_key} to "
            f"{format_amount(unit_cost)} or ask for fewer resources per replica")
    unused = total_exact - units * unit_cost
    if unused > 0 and not allow_unused:
        lower, upper = units * unit_cost, (units + 1) * unit_cost
        raise CapacityError(
            f"capacity.{total_key}", f"{total_key}={format_amount(total_exact)} is not a whole "
            f"number of ratio units {ratio} ({unit_text}): it would need fractional replicas; use "
            f"{format_amount(lower)} or {format_amount(upper)}, or set "
            "roles.capacity.allow_unused: true to leave the remainder idle")
    roles = (RolePlan("prefill", units * ratio.prefill, prefill),
             RolePlan("decode", units * ratio.decode, decode))
    return ReplicaPlan(roles, ratio, resource, total_exact, unused)


def derive_single_role(role: str, total: float, resource: DividedResource,
                       resources: ReplicaResources, *, allow_unused: bool = False) -> ReplicaPlan:
    """Replicas of one role filling ``total`` (colocated mode): the same rule with a 0:1 ratio."""
    total_exact = exact(total)
    total_key = f"total_{resource.lower()}s"
    cost = resources.amount(resource)
    if cost <= 0:
        raise CapacityError(
            f"{role}.resources.num_{resource.lower()}s",
            f"roles.capacity divides {total_key} but each {role} replica asks for 0 {resource}; "
            f"set roles.{role}.resources.num_{resource.lower()}s > 0")
    replicas = math.floor(total_exact / cost)
    if replicas < 1:
        raise CapacityError(
            f"capacity.{total_key}", f"{total_key}={format_amount(total_exact)} cannot hold one "
            f"{role} replica of {format_amount(cost)} {resource}; raise {total_key}")
    unused = total_exact - replicas * cost
    if unused > 0 and not allow_unused:
        raise CapacityError(
            f"capacity.{total_key}", f"{total_key}={format_amount(total_exact)} is not a whole "
            f"number of {role} replicas of {format_amount(cost)} {resource}; use "
            f"{format_amount(replicas * cost)} or {format_amount((replicas + 1) * cost)}, or set "
            "roles.capacity.allow_unused: true")
    return ReplicaPlan((RolePlan(role, replicas, resources),), None, resource, total_exact, unused)


def check_fits_cluster(plan: ReplicaPlan, cluster_resources: Mapping[str, float],
                       extra_demand: Mapping[str, float] | None = None) -> None:
    """Refuse a plan whose start-up demand exceeds ``cluster_resources`` (as from
    ``ray.cluster_resources()``); ``extra_demand`` adds e.g. the ingress replicas."""
    demand = plan.demand()
    for name, amount in (extra_demand or {}).items():
        demand[name] = demand.get(name, Fraction(0)) + exact(amount)
    for name, needed in sorted(demand.items()):
        if needed <= 0:
            continue
        # Ray reports resources as floats rounded to 1e-4; compare at that precision.
        available = exact(round(float(cluster_resources.get(name, 0.0)), 4))
        if name not in cluster_resources and name not in ("CPU", "GPU"):
            raise CapacityError(
                "resources.custom", f"the config asks for custom resource {name!r} "
                f"({format_amount(needed)} in all) but no node in the cluster has it; start a node "
                f"with --resources '{{\"{name}\": {format_amount(needed)}}}' or remove it")
        if needed > available:
            raise CapacityError(
                "resources", f"the replicas need {format_amount(needed)} {name} in all "
                f"({plan.summary()}) but the cluster has {format_amount(available)}; lower "
                "replicas or per-replica resources, or add nodes")


@dataclass(frozen=True)
class RatioBand:
    """Allowed range of prefill/decode replica ratios: ``low <= p/d <= high``."""

    low: Fraction
    high: Fraction

    def __post_init__(self) -> None:
        if self.low <= 0 or self.high < self.low:
            raise CapacityError(
                "ratio_band", f"ratio band needs 0 < min <= max, got {self.low}..{self.high}")

    @classmethod
    def from_ratios(cls, low: RatioTerms, high: RatioTerms) -> RatioBand:
        return cls(low.fraction, high.fraction)

    def describe(self) -> str:
        low, high = self.low, self.high
        return f"{low.numerator}:{low.denominator}..{high.numerator}:{high.denominator}"


def check_ratio_band(prefill_replicas: int, decode_replicas: int, band: RatioBand) -> bool:
    """Whether prefill:decode lies inside the band (a role with 0 replicas never does)."""
    if prefill_replicas <= 0 or decode_replicas <= 0:
        return False
    return band.low <= Fraction(prefill_replicas, decode_replicas) <= band.high


def clamp_to_band(role: RoleName, proposed: int, prefill_replicas: int, decode_replicas: int,
                  band: RatioBand, min_replicas: int, max_replicas: int) -> int:
    """The replica count for ``role`` nearest to ``proposed`` that keeps the band with the other
    role at its current count and stays within [min_replicas, max_replicas].

    Ties go to the smaller count. When no count of this role can restore the band (the other
    role must move first), the role's current count is returned: no change beats a violation.
    """
    if role == "prefill":
        other = decode_replicas
        current = prefill_replicas
        # low <= n/d <= high  <=>  ceil(low*d) <= n <= floor(high*d)
        lo, hi = math.ceil(band.low * other), math.floor(band.high * other)
    else:
        other = prefill_replicas
        current = decode_replicas
        # low <= p/n <= high  <=>  ceil(p/high) <= n <= floor(p/low)
        lo, hi = math.ceil(other / band.high), math.floor(other / band.low)
    lo, hi = max(lo, min_replicas, 1), min(hi, max_replicas)
    if lo > hi:
        return current
    return min(max(proposed, lo), hi)
