"""Each worker reports its load once, to Serve; the ingress reads those reports from its
handles: its /metrics shows every replica's gauges before any request went through."""

from __future__ import annotations

from typing import TYPE_CHECKING

import httpx
import pytest

from tests.support.ray_serve import app_config
from tests.support.waiting import wait_for

if TYPE_CHECKING:
    from tests.support.ray_serve import ServedApps

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _gauges(url: str) -> dict[str, float]:
    """role -> pdserve:kv_cache_usage_perc of its replica."""
    found = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("pdserve:kv_cache_usage_perc{"):
            role = line.split('role="', 1)[1].split('"', 1)[0]
            found[role] = float(line.rsplit(" ", 1)[1])
    return found


def test_replica_loads_reach_the_ingress_before_any_request(
        ray_serve: ServedApps, tiny_checkpoints: dict[str, str]) -> None:
    with ray_serve.deploy("loads", app_config(tiny_checkpoints["llama"], "disaggregated")) as url:
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200  # starts the monitor
        wait_for(lambda: set(_gauges(url)) == {"decode", "prefill"}, 30,
                 "both roles' load gauges in /metrics", interval_s=0.2)
        assert _gauges(url) == {"decode": 0.0, "prefill": 0.0}
