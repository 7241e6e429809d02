"""Lending idle workers' cores: a step takes an idle set's cores as more torch threads and
gives them back, a busy or wanting worker lends nothing, and a worker that wants its cores
back waits for one borrowed step only. The scenario runs in a child process."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path
from typing import Any

import pytest

from pdserve.cluster.config import PdserveConfig
from tests.engine.cpu_claim_child import lend_and_borrow

CTX = multiprocessing.get_context("spawn")
CORES = sorted(os.sched_getaffinity(0))


@pytest.mark.skipif(len(CORES) < 2, reason="lending a core to another worker needs 2+ cores")
def test_an_idle_workers_cores_run_a_step_and_come_back(tmp_path: Path) -> None:
    out = CTX.Queue()
    child = CTX.Process(target=lend_and_borrow,
                        args=(str(tmp_path), [str(CORES[0]), str(CORES[1])], out))
    child.start()
    seen = out.get(timeout=120)
    child.join(30)
    a, b = seen["a"], seen["b"]
    assert seen["threads_while_a_busy"] == 1  # a claim holds its lease: nothing to borrow
    assert seen["threads_small_step"] == 1
    assert seen["threads_lent"] == 2 and seen["engine_cores_lent"] == b
    assert seen["a_waits_for_the_step"] and not seen["lendable_while_wanted"]
    assert seen["a_back"] and seen["a_back_lent_steps"] == 1
    # The engine thread back on its own core; the pool's worker on the core it was lent.
    assert seen["threads_after"] == 1 and seen["engine_cores_after"] == b
    assert seen["workers"] and set(map(tuple, seen["workers"].values())) == {tuple(a)}
    assert seen["threads_after_a_back"] == 1 and seen["lent_steps"] == 1


def test_lending_is_off_by_default_and_can_be_turned_on(tmp_path: Path) -> None:
    base = {"model": {"path": str(tmp_path)}, "mode": "colocated",
            "roles": {"decode": {"replicas": 2}}, "engine": {"cpu_affinity": {"decode": [0, 1]}}}
    assert not PdserveConfig.model_validate(base).engine.cpu_lending
    base["engine"]["cpu_lending"] = True
    assert PdserveConfig.model_validate(base).engine.cpu_lending


def test_only_pinned_one_rank_cpu_workers_lend(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from pdserve.engine.cpu_affinity import claim_core_set
    from pdserve.engine.cpu_lending import CoreLending, lending
    from tests.engine.cpu_claim_child import affinity

    aff = affinity(tmp_path, "0", "1")
    claim = claim_core_set(aff, "decode")
    try:
        def engine(tp: int, device: str) -> Any:
            return SimpleNamespace(tp=SimpleNamespace(size=tp),
                                   device=SimpleNamespace(type=device))

        def config(on: bool, pinned: bool = True) -> Any:
            return SimpleNamespace(cpu_lending=on, cpu_affinity=aff if pinned else None)

        made = lending(config(True), claim, engine(1, "cpu"))
        assert isinstance(made, CoreLending)
        made.close()
        assert lending(config(False), claim, engine(1, "cpu")) is None
        assert lending(config(True, pinned=False), None, engine(1, "cpu")) is None
        assert lending(config(True), claim, engine(2, "cpu")) is None  # TP ranks keep theirs
        assert lending(config(True), claim, engine(1, "cuda")) is None
    finally:
        claim.release()
