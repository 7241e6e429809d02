"""A worker killed at each phase of a handoff, as the OS kills a process: every answer is the
one-engine greedy text or a clear error, never a wrong 200, and every block comes back.

Each round arms one fault point (`pdserve.faults`) in the app's replica of that role; the
first request to reach the point kills it. `benchmarks/fault_hammer.py` runs many rounds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from pdserve.faults import POINTS
from tests.support.fault_rounds import deployed_faults_app, greedy_fixture, kill_round

if TYPE_CHECKING:
    from tests.support.ray_serve import ServedApps

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP = "phases"
NUM_REQUESTS = 4


phases_app = deployed_faults_app(APP)
greedy = greedy_fixture(NUM_REQUESTS)


@pytest.mark.parametrize("point", sorted(POINTS))
def test_a_worker_killed_at_a_handoff_phase_gives_no_wrong_answer(
        ray_serve: ServedApps, phases_app: str, greedy: dict[int, str], point: str) -> None:
    result = kill_round(ray_serve, APP, point, greedy, NUM_REQUESTS)
    assert result.fired, f"no request reached {point}: the round tested nothing"
    wrong = [o.detail for o in result.outcomes if o.kind == "wrong"]
    assert not wrong, f"wrong answers after a kill at {point}: {wrong}"
    if point.startswith("prefill."):  # decode recomputes whatever prefill lost
        assert result.count("right") == NUM_REQUESTS, result.outcomes
