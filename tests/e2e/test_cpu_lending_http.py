"""Served colocated replicas pinned one core each, with engine.cpu_lending, lend their core
while idle: a prompt on an idle server runs its prefill on both cores (/metrics counts the
lent steps), every answer still comes back, and every block is free after."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import httpx
import pytest

from pdserve.engine.cpu_lending import MIN_LENT_TOKENS
from tests.support.ray_serve import app_config
from tests.support.waiting import wait_for

if TYPE_CHECKING:
    from tests.support.ray_serve import ServedApps

pytestmark = [pytest.mark.ray, pytest.mark.slow]
CORES = sorted(os.sched_getaffinity(0))


def _lent_steps(url: str) -> float:
    lines = httpx.get(f"{url}/metrics", timeout=30).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith("pdserve:cpu_lent_steps{"))


@pytest.mark.skipif(len(CORES) < 2, reason="lending a core to another replica needs 2+ cores")
def test_an_idle_replicas_core_runs_the_others_prefill(
        ray_serve: ServedApps, tiny_checkpoints: dict[str, str]) -> None:
    raw = app_config(tiny_checkpoints["llama"], "colocated")
    raw["roles"]["decode"]["replicas"] = 2
    raw["engine"]["cpu_affinity"] = {"decode": [CORES[0], CORES[1]]}
    raw["engine"]["cpu_lending"] = True
    with ray_serve.deploy("lending", raw) as url, httpx.Client(timeout=60) as client:
        assert _lent_steps(url) == 0
        for seed in range(3):  # one at a time: the other replica idles meanwhile
            prompt = [(seed * 97 + k * 13) % 1000 + 3 for k in range(4 * MIN_LENT_TOKENS)]
            r = client.post(f"{url}/v1/completions", json={
                "model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4
        wait_for(lambda: _lent_steps(url) >= 3, 30, "three prefills on a lent core")
        ray_serve.wait_all_free("lending")
