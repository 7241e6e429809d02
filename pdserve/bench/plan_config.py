"""A pdserve config written from a plan: the profiled config with the planned ``roles.capacity``
in place of its replica counts, checked by pdserve's own config parser before it is written.

Pinned cores (engine.cpu_affinity) are handed out again for the new counts, from the cores the
profiled config used and in sets of the sizes it used; when they are too few, pinning is dropped
and the returned note says so.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from pdserve.bench.planner import Plan
from pdserve.cluster.config import parse_config
from pdserve.engine.cpu_affinity import format_cpu_list, parse_cpu_list


def planned_config(raw: Mapping[str, Any], plan: Plan) -> tuple[dict[str, Any], str | None]:
    """(the new config mapping, a note about pinning or None); refuses what pdserve refuses."""
    data = copy.deepcopy(dict(raw))
    data["mode"] = "disaggregated"
    roles = data.setdefault("roles", {})
    for role in ("prefill", "decode"):
        roles.setdefault(role, {}).pop("replicas", None)
    roles["capacity"] = plan.capacity_fragment()["roles"]["capacity"]
    note = _repin(data, {"prefill": plan.prefill_replicas, "decode": plan.decode_replicas})
    parse_config(data, source="planned config")
    return data, note


def _repin(data: dict[str, Any], counts: Mapping[str, int]) -> str | None:
    engine = data.get("engine") or {}
    affinity = engine.get("cpu_affinity")
    if not affinity:
        return None
    sets = {role: [parse_cpu_list(s) for s in entries] for role, entries in affinity.items()}
    cores = sorted(set().union(*(c for entries in sets.values() for c in entries)))
    sizes = {role: len(sets[role][0]) if sets.get(role) else 1 for role in counts}
    need = sum(counts[r] * sizes[r] for r in counts)
    if need > len(cores):
        del engine["cpu_affinity"]
        return (f"engine.cpu_affinity dropped: {need} cores needed for the planned replicas, "
                f"the profiled config pinned {len(cores)}")
    free = iter(cores)
    engine["cpu_affinity"] = {
        role: [format_cpu_list({next(free) for _ in range(sizes[role])})
               for _ in range(counts[role])] for role in ("prefill", "decode")}
    return None


def write_planned_config(raw: Mapping[str, Any], plan: Plan, path: Path) -> str | None:
    data, note = planned_config(raw, plan)
    header = (f"# Written by `pdserve plan`: {plan.prefill_replicas} prefill + "
              f"{plan.decode_replicas} decode replicas, sustaining {plan.sustained_rate:g} "
              "req/s by the profiles.\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + yaml.safe_dump(data, sort_keys=False))
    return note
