"""The shipped benchmark configs: every one loads as `pdserve serve` would, and the compared
setups ask for equal resources with every worker on cores of its own."""

from __future__ import annotations

from pathlib import Path

from pdserve.bench.compare import check_equal_resources, load_setups
from pdserve.cluster.config import load_config

BENCH = Path(__file__).resolve().parents[2] / "configs" / "bench"
COMPARED = ("colocated-2x1.yaml", "disagg-1p1d.yaml", "colocated-1x2.yaml")


def test_every_bench_config_loads() -> None:
    paths = sorted(BENCH.glob("*.yaml"))
    assert {p.name for p in paths} >= set(COMPARED)
    for path in paths:
        load_config(path)


def test_compared_setups_share_two_pinned_cores() -> None:
    totals = check_equal_resources(load_setups([BENCH / name for name in COMPARED]))
    assert {tuple(sorted(t.items())) for t in totals.values()} == {
        (("CPU", 2), ("pinned cores", 2))}
    for name in COMPARED:
        sets = load_config(BENCH / name).engine.core_sets()
        assert sorted(c for role in sets.values() for s in role for c in s) == [0, 1]
