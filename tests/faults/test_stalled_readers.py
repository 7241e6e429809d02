"""Clients that stop reading cannot hold the server: 16 streams whose replies do not fit the
socket buffers (top_logprobs 20, a 2 KiB receive buffer, never read) fill every admission
slot, and `http.stalled_stream_timeout_s` later they are ended (counted `stalled`), other
requests are admitted again, the ingress's memory stays bounded and every KV block is back."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import httpx
import pytest

from tests.support import raw_http
from tests.support.processes import replica_pids, rss_mb
from tests.support.waiting import wait_for

if TYPE_CHECKING:
    from tests.support.ray_serve import ServedApps

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP = "stalled"
LIMIT = 16
STALL_TIMEOUT_S = 3.0
# The watch looks every timeout / 4: a stream is ended at most two looks after its timeout.
ENDED_WITHIN_S = STALL_TIMEOUT_S * 1.5 + 1.0
RSS_BOUND_MB = 60.0
PROMPT = "Write a long story about a lighthouse keeper and the sea, with many details. " * 3
STALLING = {"model": "tiny", "stream": True, "max_tokens": 3000, "temperature": 0,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 20,
            "messages": [{"role": "user", "content": PROMPT}]}
PROBE = {"model": "tiny", "max_tokens": 4, "temperature": 0,
         "messages": [{"role": "user", "content": "Are you there?"}]}


@pytest.fixture(scope="module")
def stalled_app(ray_serve: ServedApps, tiny_checkpoints: dict[str, str]) -> Iterator[str]:
    from tests.support.ray_serve import app_config

    config = app_config(tiny_checkpoints["llama"], "disaggregated", max_in_flight_requests=LIMIT)
    config["http"] = {"stalled_stream_timeout_s": STALL_TIMEOUT_S}
    with ray_serve.deploy(APP, config) as url:
        yield url


def _metric(url: str, name: str, label: str = "") -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(f"pdserve:{name}") and label in line)


def test_sixteen_stalled_readers_are_ended_and_free_everything(
        ray_serve: ServedApps, stalled_app: str) -> None:
    [ingress] = replica_pids(APP, "ingress")
    # The new ingress's first scrape, before any completion, has every role's KV gauge.
    gauges = httpx.get(f"{stalled_app}/metrics", timeout=30).text.split(
        "pdserve:kv_cache_usage_perc")[-1]
    assert 'role="decode"' in gauges and 'role="prefill"' in gauges, gauges
    rss_before = rss_mb(ingress)
    stalled_before = _metric(stalled_app, "requests_total", 'status="stalled"')
    sockets: list[socket.socket] = []
    try:
        sockets = [raw_http.open_unread(stalled_app, "/v1/chat/completions", STALLING)
                   for _ in range(LIMIT)]
        wait_for(lambda: _metric(stalled_app, "num_requests_in_flight") == LIMIT, 60,
                 "every slot taken by a stalled reader")
        full_at = time.monotonic()
        assert httpx.post(f"{stalled_app}/v1/chat/completions", json=PROBE,
                          timeout=30).status_code == 429
        rss_peak = rss_before

        def admitted() -> bool:
            nonlocal rss_peak
            rss_peak = max(rss_peak, rss_mb(ingress))
            r = httpx.post(f"{stalled_app}/v1/chat/completions", json=PROBE, timeout=30)
            assert r.status_code in (200, 429), r.text
            return r.status_code == 200

        wait_for(admitted, ENDED_WITHIN_S + 10, "a request admitted again", interval_s=0.2)
        waited_s = time.monotonic() - full_at
        wait_for(lambda: _metric(stalled_app, "requests_total", 'status="stalled"')
                 - stalled_before == LIMIT, 30, "every stalled reader counted stalled")
        ray_serve.wait_all_free(APP)
        rss_after = rss_mb(ingress)
    finally:
        for sock in sockets:
            sock.close()
    print(f"{LIMIT} stalled readers (timeout {STALL_TIMEOUT_S:g} s): a request admitted again "
          f"{waited_s:.1f} s after every slot was taken; all {LIMIT} counted stalled, every KV "
          f"block back; ingress RSS {rss_before:.0f} MB before, {rss_peak:.0f} MB peak, "
          f"{rss_after:.0f} MB after")
    assert waited_s <= ENDED_WITHIN_S
    assert rss_peak - rss_before <= RSS_BOUND_MB
