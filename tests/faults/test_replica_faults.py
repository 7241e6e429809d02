"""Replicas dying under load, as a process killed by the OS dies: every affected request ends
with the right answer (greedy parity) or a clear error, the live replicas get every block
back, and the app keeps serving while Serve restarts what died."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import httpx
import pytest

from tests.support.fault_rounds import deployed_faults_app, greedy_fixture, long_conv
from tests.support.processes import replica_pids
from tests.support.waiting import wait_for

if TYPE_CHECKING:
    from tests.support.ray_serve import ServedApps

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP = "faults"
MAX_TOKENS = 16


faults_app = deployed_faults_app(APP)
greedy = greedy_fixture(12, MAX_TOKENS)


def chat(url: str, i: int, stream: bool = False, timings: bool = False) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": long_conv(i), "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "stream": stream, "pdserve_timings": timings})


def health(url: str) -> tuple[int, dict]:
    try:
        r = httpx.get(f"{url}/health", timeout=5)
        return r.status_code, r.json()
    except httpx.HTTPError:
        return 0, {}


def test_a_killed_prefill_replica_loses_no_request_and_long_prompts_go_to_decode(
        ray_serve: ServedApps, faults_app: str, greedy: dict[int, str]) -> None:
    wait_for(lambda: health(faults_app)[0] == 200, 60, "the app to be healthy")
    [prefill_pid] = replica_pids(APP, "prefill")
    with ThreadPoolExecutor(max_workers=6) as pool:
        in_flight = [pool.submit(chat, faults_app, i) for i in range(6)]
        # Killed once decode holds reservations whose KV is being prefilled and sent.
        wait_for(lambda: ray_serve.kv_stats(APP)["decode"]["num_awaiting_kv"] > 0, 60,
                 "transfers in flight")
        os.kill(prefill_pid, signal.SIGKILL)
        answers = [f.result(timeout=120) for f in in_flight]
    for i, r in enumerate(answers):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == greedy[i]

    # The failed calls told the ingress that prefill has no replica until a new one answers.
    status, body = health(faults_app)
    assert (status, body["missing_roles"]) == (503, ["prefill"])
    wait_for(lambda: health(faults_app)[0] == 200, 90, "the prefill replica to be back")
    r = chat(faults_app, 8, timings=True)
    assert r.json()["choices"][0]["message"]["content"] == greedy[8]
    t = r.json()["pdserve_timings"][0]
    assert t["path"] == "disaggregated", (t["fallback_reason"], t["handoff_error"])
    ray_serve.wait_all_free(APP)


def test_while_prefill_is_down_health_says_so_and_decode_prefills(
        ray_serve: ServedApps, faults_app: str, greedy: dict[int, str]) -> None:
    wait_for(lambda: health(faults_app)[0] == 200, 90, "the app to be healthy")
    [prefill_pid] = replica_pids(APP, "prefill")
    os.kill(prefill_pid, signal.SIGKILL)
    wait_for(lambda: health(faults_app)[0] == 503, 30, "/health to report prefill missing")
    assert health(faults_app)[1]["missing_roles"] == ["prefill"]
    start = time.monotonic()
    r = chat(faults_app, 9, timings=True)
    assert r.status_code == 200, r.text
    assert time.monotonic() - start < 5.0  # not the ~10 s Serve takes to restart it
    assert r.json()["choices"][0]["message"]["content"] == greedy[9]
    assert r.json()["pdserve_timings"][0]["fallback_reason"] == "no_prefill_replica"
    wait_for(lambda: health(faults_app)[0] == 200, 90, "the prefill replica to be back")
    ray_serve.wait_all_free(APP)


def test_a_killed_decode_replica_ends_its_streams_with_a_clear_error(
        ray_serve: ServedApps, faults_app: str, greedy: dict[int, str]) -> None:
    wait_for(lambda: health(faults_app)[0] == 200, 90, "the app to be healthy")
    [decode_pid] = replica_pids(APP, "decode")
    events: dict[int, list[str]] = {i: [] for i in range(3)}
    started = threading.Barrier(4)

    def stream(i: int) -> None:
        body = {"model": "tiny", "messages": long_conv(i), "max_tokens": 2000,
                "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{faults_app}/v1/chat/completions", json=body,
                          timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events[i].append(line[6:])
                    if len(events[i]) == 3:
                        started.wait(60)

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    started.wait(60)
    os.kill(decode_pid, signal.SIGKILL)
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    for i in range(3):
        assert events[i][-1] == "[DONE]", events[i][-3:]
        error = json.loads(events[i][-2])["error"]
        assert error["message"] and error["type"] == "server_error"
        for leak in ("pid=", "actor_id", "namespace", "Traceback", "192.0.2"):
            assert leak not in error["message"], error["message"]
    wait_for(lambda: health(faults_app)[0] == 200, 90, "the decode replica to be back")
    r = chat(faults_app, 10)
    assert r.json()["choices"][0]["message"]["content"] == greedy[10]
    ray_serve.wait_all_free(APP)  # prefill released the blocks it was sending from


def test_a_prefill_replica_stopped_by_a_downscale_finishes_its_transfers(
        ray_serve: ServedApps, tiny_checkpoints: dict[str, str], greedy: dict[int, str]) -> None:
    """Serve stops one of two prefill replicas while prompts are being prefilled and sent:
    it waits for their prefill calls, and the replica waits for their KV to arrive, so none
    is recomputed on decode."""
    from tests.support.ray_serve import app_config

    raw = app_config(tiny_checkpoints["llama"], "disaggregated")
    raw["roles"]["prefill"]["replicas"] = 2
    raw["roles"]["prefill"]["resources"] = {"num_cpus": 0.5}
    raw["router"]["prefill_policy"] = "round_robin"
    with ray_serve.deploy("scale", raw) as url:
        wait_for(lambda: len(replica_pids("scale", "prefill")) == 2, 60, "two prefill replicas")
        with ThreadPoolExecutor(max_workers=8) as pool:
            in_flight = [pool.submit(chat, url, i, False, True) for i in range(8)]
            wait_for(lambda: ray_serve.kv_stats("scale")["decode"]["num_awaiting_kv"] >= 2,
                     60, "transfers in flight on both replicas")
            raw["roles"]["prefill"]["replicas"] = 1
            ray_serve.start_app("scale", raw)  # Serve stops one replica gracefully
            answers = [f.result(timeout=120) for f in in_flight]
        for i, r in enumerate(answers):
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == greedy[i]
            [t] = r.json()["pdserve_timings"]
            assert t["path"] == "disaggregated", (i, t["fallback_reason"], t["handoff_error"])
        wait_for(lambda: len(replica_pids("scale", "prefill")) == 1, 60, "one prefill replica")
        ray_serve.wait_all_free("scale")
