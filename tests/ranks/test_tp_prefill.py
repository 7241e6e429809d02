"""A prefill replica of two tensor-parallel ranks into a decode replica of one, over real
HTTP, UCXX and Ray Serve: each prefill rank sends the KV head it holds from its own cache,
greedy answers equal one rank's, and a prompt whose prefix decode still caches moves only the
blocks after it. Prefill rank 1 killed by the OS while requests run: each ends with the right
answer or a clear error, decode gets every block back, Serve replaces the prefill replica,
and the new one serves the right answer."""

from __future__ import annotations

import os
import signal
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import httpx
import pytest

from pdserve.cluster.config import engine_config
from pdserve.engine.engine import LLMEngine
from tests.support.processes import rank_pids, replica_pids
from tests.support.tp_reuse import SYSTEM, chat, check_greedy_and_prefix_reuse, reference
from tests.support.waiting import wait_for

if TYPE_CHECKING:
    from tests.support.ray_serve import ServedApps

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP = "tp_prefill"


@pytest.fixture(scope="module")
def tp_app(ray_serve: ServedApps, tiny_checkpoints: dict[str, str]) -> Iterator[str]:
    from tests.support.ray_serve import app_config

    raw = app_config(tiny_checkpoints["llama"], "disaggregated")
    raw["roles"]["prefill"]["tensor_parallel_size"] = 2
    raw["roles"]["prefill"]["collective_timeout_s"] = 10
    with ray_serve.deploy(APP, raw) as url:
        yield url


@pytest.fixture(scope="module")
def engine(tiny_checkpoints: dict[str, str]) -> LLMEngine:
    """One rank, in this process: the reference answers and token counts."""
    return LLMEngine(engine_config(tiny_checkpoints["llama"], num_kv_blocks=256))


def health(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0


def test_prefill_two_ranks_to_decode_one_rank_greedy_and_prefix_reuse(
        ray_serve: ServedApps, tp_app: str, engine: LLMEngine) -> None:
    wait_for(lambda: health(tp_app) == 200, 60, "the app to be healthy")
    assert len(replica_pids(APP, "prefill")) == 1 and len(rank_pids()) == 1
    check_greedy_and_prefix_reuse(tp_app, engine)
    ray_serve.wait_all_free(APP)


def test_a_killed_prefill_rank_ends_requests_cleanly_and_serve_replaces_the_replica(
        ray_serve: ServedApps, tp_app: str, engine: LLMEngine) -> None:
    wait_for(lambda: health(tp_app) == 200, 60, "the app to be healthy")
    [prefill_pid] = replica_pids(APP, "prefill")
    [rank_pid] = rank_pids()  # the prefill replica's rank 1 (decode has one rank)
    prompts = [[{"role": "user", "content": f"Request {i}. {SYSTEM * 2}"}] for i in range(4)]
    wants = [reference(engine, messages)[0] for messages in prompts]
    results: list[tuple[int, httpx.Response]] = []
    stop = threading.Event()

    def ask_until_stopped(i: int) -> None:  # back to back: prefill is busy when the rank dies
        while not stop.is_set():
            results.append((i, httpx.post(f"{tp_app}/v1/chat/completions", timeout=120, json={
                "model": "tiny", "messages": prompts[i], "max_tokens": 10, "temperature": 0,
                "ignore_eos": True, "pdserve_timings": True})))

    with ThreadPoolExecutor(max_workers=4) as pool:
        loops = [pool.submit(ask_until_stopped, i) for i in range(4)]
        wait_for(lambda: len(results) >= 4, 60, "requests to flow")
        answered_before = len(results)
        os.kill(rank_pid, signal.SIGKILL)
        wait_for(lambda: len(results) >= answered_before + 8, 120,
                 "requests to keep being answered")
        stop.set()
        for loop in loops:
            loop.result(timeout=120)  # nothing waits on the dead rank past its request
    outcomes: Counter[str] = Counter()
    for i, r in results:
        if r.status_code == 200:  # prefilled before the kill, or recomputed by decode
            body = r.json()
            assert body["choices"][0]["message"]["content"] == wants[i]
            [t] = body["pdserve_timings"]
            outcomes[t["path"] if t["path"] == "disaggregated" else "recomputed on decode"] += 1
        else:
            assert r.status_code in (500, 503) and r.json()["error"]["message"], r.text
            outcomes[f"error {r.status_code}"] += 1
    print(f"{len(results)} requests, {answered_before} before the kill: {dict(outcomes)}")
    assert sum(outcomes.values()) - outcomes["disaggregated"] >= 1  # the kill hit some
    wait_for(lambda: replica_pids(APP, "prefill") not in ([], [prefill_pid])
             and len(rank_pids()) == 1 and rank_pid not in rank_pids(), 120,
             "Serve to replace the prefill replica and its rank")
    wait_for(lambda: health(tp_app) == 200, 60, "the app to be healthy again")
    messages = [{"role": "user", "content": f"After the restart. {SYSTEM}"}]
    body = chat(tp_app, messages)
    assert body["choices"][0]["message"]["content"] == reference(engine, messages)[0]
    assert body["pdserve_timings"][0]["path"] == "disaggregated"
    assert body["pdserve_timings"][0]["handoff_bytes"] > 0
    ray_serve.wait_all_free(APP)  # decode's blocks, and the new prefill replica's
