"""A soak: mixed prompt lengths, streamed and whole answers, clients that give up at random
and one replica killed halfway. Every answer that completes is the engine's greedy answer,
every block comes back, and the processes that lived throughout hold their memory steady.

Runs `PDSERVE_SOAK_S` seconds (default 90; set it higher for a longer soak).
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING

import httpx
import pytest

from pdserve.cluster.config import engine_config
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from tests.support.processes import replica_pids, rss_mb
from tests.support.waiting import wait_for

if TYPE_CHECKING:
    from tests.support.ray_serve import ServedApps

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]

APP = "soak"
SOAK_S = float(os.environ.get("PDSERVE_SOAK_S", "90"))
CLIENTS = 6
MAX_TOKENS = 24
# Short prompts are prefilled on decode, long ones on the prefill worker and handed off.
PROMPTS = [f"Question {i}: " + "tell me about the sea and its ships. " * n
           for i, n in enumerate((1, 2, 3, 12, 25, 40, 60, 80))]
RSS_GROWTH_LIMIT_MB = 150.0


@pytest.fixture(scope="module")
def soak_app(ray_serve: ServedApps, tiny_checkpoints: dict[str, str]) -> Iterator[str]:
    from tests.support.ray_serve import app_config

    raw = app_config(tiny_checkpoints["llama"], "disaggregated", max_in_flight_requests=32)
    raw["handoff"]["timeout_s"] = 8
    with ray_serve.deploy(APP, raw) as url:
        yield url


@pytest.fixture(scope="module")
def greedy(tiny_checkpoints: dict[str, str]) -> list[str]:
    engine = LLMEngine(engine_config(tiny_checkpoints["llama"], num_kv_blocks=256))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [engine.tokenizer.decode(engine.generate([engine.tokenizer.encode(p)], params)[0])
            for p in PROMPTS]


class Client(threading.Thread):
    """Sends random requests until ``stop``; tallies how each ended and every wrong text."""

    def __init__(self, url: str, greedy: list[str], seed: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.url, self.greedy, self.stop = url, greedy, stop
        self.rng = random.Random(seed)
        self.outcomes: Counter[str] = Counter()
        self.wrong: list[tuple[int, str]] = []

    def run(self) -> None:
        with httpx.Client(timeout=60) as http:
            while not self.stop.is_set():
                self.outcomes[self.one(http)] += 1

    def one(self, http: httpx.Client) -> str:
        i = self.rng.randrange(len(PROMPTS))
        body = {"model": "tiny", "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True}
        give_up_after = self.rng.choice([None, None, None, 1, 3])  # chunks, for streams
        try:
            if self.rng.random() < 0.5:
                r = http.post(f"{self.url}/v1/completions", json=body)
                if r.status_code != 200:
                    return f"http {r.status_code}"
                return self.check(i, r.json()["choices"][0]["text"])
            text, chunks = "", 0
            with http.stream("POST", f"{self.url}/v1/completions",
                             json={**body, "stream": True}) as r:
                if r.status_code != 200:
                    r.read()
                    return f"http {r.status_code}"
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    if '"error"' in line[:20]:
                        return "error event"
                    chunks += 1
                    if give_up_after is not None and chunks >= give_up_after:
                        return "gave up"
                    text += json.loads(line[6:])["choices"][0]["text"]
            return self.check(i, text)
        except httpx.HTTPError as exc:
            return f"transport {type(exc).__name__}"

    def check(self, i: int, text: str) -> str:
        if text != self.greedy[i]:
            self.wrong.append((i, text))
            return "wrong"
        return "ok"


def test_soak_with_cancellations_and_a_replica_kill(ray_serve: ServedApps, soak_app: str,
                                                    greedy: list[str]) -> None:
    wait_for(lambda: httpx.get(f"{soak_app}/health", timeout=5).status_code == 200, 60,
             "the soak app to be healthy")
    stop = threading.Event()
    clients = [Client(soak_app, greedy, seed, stop) for seed in range(CLIENTS)]
    for client in clients:
        client.start()
    time.sleep(min(10.0, SOAK_S / 4))  # warmed up: caches, pools and buffers at their size
    [ingress] = replica_pids(APP, "ingress")
    [survivor] = replica_pids(APP, "decode")
    rss_start = {pid: rss_mb(pid) for pid in (ingress, survivor)}
    deadline = time.monotonic() + SOAK_S
    time.sleep(SOAK_S / 2)
    [victim] = replica_pids(APP, "prefill")
    os.kill(victim, signal.SIGKILL)
    time.sleep(max(0.0, deadline - time.monotonic()))
    stop.set()
    for client in clients:
        client.join(120)
        assert not client.is_alive()
    outcomes = sum((c.outcomes for c in clients), Counter())
    print(f"soak {SOAK_S:.0f} s, {sum(outcomes.values())} requests: {dict(outcomes)}")
    assert [w for c in clients for w in c.wrong] == []
    assert outcomes["ok"] > 20 * CLIENTS
    # Killing prefill loses nothing: its requests are recomputed on decode, none fail.
    assert set(outcomes) <= {"ok", "gave up"}, outcomes
    wait_for(lambda: httpx.get(f"{soak_app}/health", timeout=5).status_code == 200, 90,
             "the prefill replica to be back")
    ray_serve.wait_all_free(APP)
    growth = {pid: rss_mb(pid) - rss_start[pid] for pid in rss_start}
    print(f"RSS growth MB: {growth}")
    assert all(g < RSS_GROWTH_LIMIT_MB for g in growth.values()), growth
