"""A config written from a plan: replica counts replaced by the planned roles.capacity, pinned
cores handed out again (or dropped when too few), and accepted by `pdserve serve`'s parser."""

from __future__ import annotations

from pathlib import Path

import yaml

from pdserve.bench.plan_config import planned_config, write_planned_config
from pdserve.bench.planner import Plan
from pdserve.cluster.config import load_config


def profiled(prefill_cores: str, decode_cores: str, cpus: int) -> dict:
    return {"model": {"path": "/models/x"}, "mode": "disaggregated",
            "engine": {"device": "cpu",
                       "cpu_affinity": {"prefill": [prefill_cores], "decode": [decode_cores]}},
            "roles": {"prefill": {"replicas": 1, "resources": {"num_cpus": cpus}},
                      "decode": {"replicas": 1, "resources": {"num_cpus": cpus}}}}


def plan(p: int, d: int, cost: float = 1.0) -> Plan:
    return Plan(p, d, 1.0, 1.0, "CPU", cost, cost, None, None, ())


def test_counts_become_capacity_and_cores_are_handed_out_again() -> None:
    data, note = planned_config(profiled("0-1", "2-3", 2), plan(1, 1, cost=2))
    assert note is None
    assert data["roles"]["capacity"] == {"ratio": "1:1", "total_cpus": 4}
    assert "replicas" not in data["roles"]["prefill"] and "replicas" not in data["roles"]["decode"]
    assert data["engine"]["cpu_affinity"] == {"prefill": ["0-1"], "decode": ["2-3"]}


def test_too_few_cores_drop_pinning_and_say_so() -> None:
    data, note = planned_config(profiled("0", "1", 1), plan(2, 1))
    assert "cpu_affinity" not in data["engine"]
    assert note is not None and "3 cores needed" in note and "pinned 2" in note


def test_the_written_config_is_what_pdserve_serve_loads(tmp_path: Path) -> None:
    raw = profiled("0", "1", 1)
    raw["engine"]["cpu_affinity"] = {"prefill": ["0"], "decode": ["1", "2", "3"]}
    raw["roles"]["decode"]["replicas"] = 3
    path = tmp_path / "planned.yaml"
    assert write_planned_config(raw, plan(1, 3), path) is None
    cfg = load_config(path)
    assert [(r.role, r.replicas) for r in cfg.replica_plan().roles] == [("prefill", 1),
                                                                       ("decode", 3)]
    assert yaml.safe_load(path.read_text())["engine"]["cpu_affinity"] == {
        "prefill": ["0"], "decode": ["1", "2", "3"]}
    assert path.read_text().startswith("# Written by `pdserve plan`: 1 prefill + 3 decode")
