"""Fault points: arming needs the worker's opt-in, names are checked, an armed point fires at
its next hit only."""

from __future__ import annotations

import pytest

from pdserve.faults import POINTS, TIER_POINTS, FaultPoints, UnknownFaultPointError


def test_an_armed_point_fires_once_at_its_own_hit() -> None:
    deaths: list[str] = []
    faults = FaultPoints(enabled=True, die=lambda: deaths.append("died"))
    faults.hit("prefill.reserved")
    assert deaths == []
    faults.arm("prefill.reserved")
    assert faults.armed("prefill.reserved") and not faults.armed("decode.decoding")
    faults.hit("decode.decoding")
    assert deaths == []
    faults.hit("prefill.reserved")
    faults.hit("prefill.reserved")
    assert deaths == ["died"] and not faults.armed("prefill.reserved")


def test_arming_needs_the_opt_in_and_a_known_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_FAULT_POINTS", raising=False)
    with pytest.raises(RuntimeError, match="PDSERVE_FAULT_POINTS=1"):
        FaultPoints().arm("prefill.reserved")
    monkeypatch.setenv("PDSERVE_FAULT_POINTS", "1")
    with pytest.raises(UnknownFaultPointError, match="prefill.reserved"):
        FaultPoints().arm("prefill.nowhere")
    assert all(role in ("prefill", "decode") for role in (p.split(".")[0] for p in POINTS))
    FaultPoints().arm("prefill.loading_kv")  # a tier's point: armed alike, not a handoff phase
    assert "prefill.loading_kv" in TIER_POINTS and "prefill.loading_kv" not in POINTS
