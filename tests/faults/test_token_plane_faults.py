"""The token plane when a process at one end dies: kill -9 of the ingress replica while a
decode worker streams to it stops those generations on the worker (aborted, not finished)
and frees every block at once, long before the request timeout."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import httpx
import pytest

from tests.support.processes import replica_pids
from tests.support.ray_serve import app_config
from tests.support.waiting import wait_for

if TYPE_CHECKING:
    from tests.support.ray_serve import ServedApps

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]

APP = "plane_faults"
REQUEST_TIMEOUT_S = 60
NUM_STREAMS = 4
LONG = {"model": "tiny", "prompt": "Once upon a time there was a long story to tell.",
        "max_tokens": 3800, "temperature": 0, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def plane_app(ray_serve: ServedApps, tiny_checkpoints: dict[str, str]) -> Iterator[str]:
    raw = app_config(tiny_checkpoints["llama"], "disaggregated",
                     request_timeout_s=REQUEST_TIMEOUT_S)
    with ray_serve.deploy(APP, raw) as url:
        yield url


def stream_until_cut(url: str, chunks: list[int], index: int) -> None:
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=LONG, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    chunks[index] += 1
    except httpx.HTTPError:
        pass  # the ingress died under it: the connection is cut


def test_a_killed_ingress_stops_its_streams_on_decode_and_frees_their_blocks(
        ray_serve: ServedApps, plane_app: str) -> None:
    ray_serve.wait_all_free(APP)
    aborted_before = ray_serve.kv_stats(APP)["decode"]["num_aborted"]
    chunks = [0] * NUM_STREAMS
    clients = [threading.Thread(target=stream_until_cut, args=(plane_app, chunks, i))
               for i in range(NUM_STREAMS)]
    for client in clients:
        client.start()
    wait_for(lambda: min(chunks) >= 20, 60, "every stream to be under way")
    [ingress_pid] = replica_pids(APP, "ingress")
    os.kill(ingress_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    wait_for(lambda: ray_serve.kv_stats(APP)["decode"]["num_running"] == 0,
             REQUEST_TIMEOUT_S, "the decode worker to stop the dead ingress's streams")
    stopped_s = time.monotonic() - killed_at
    ray_serve.wait_all_free(APP, timeout_s=REQUEST_TIMEOUT_S)
    freed_s = time.monotonic() - killed_at
    stats = ray_serve.kv_stats(APP)["decode"]
    # Stopped by the lost connection, not run to their 3,800 tokens.
    assert stats["num_aborted"] - aborted_before == NUM_STREAMS
    assert max(chunks) < LONG["max_tokens"]
    assert freed_s < REQUEST_TIMEOUT_S / 4, freed_s
    print(f"\nkill -9 of the ingress: decode stopped {NUM_STREAMS} streams in {stopped_s:.2f} s "
          f"and freed their blocks in {freed_s:.2f} s (request timeout {REQUEST_TIMEOUT_S} s)")
    for client in clients:
        client.join(30)
