"""A Serve replica of two tensor-parallel ranks (rank 0 the replica's actor, rank 1 a Ray actor
in its placement group) over real HTTP: greedy answers equal one rank's, and a rank killed by
the OS mid-stream fails its replica cleanly: every stream ends with a clear error, Serve
replaces the replica (with a new rank 1), and the app answers correctly again."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import httpx
import pytest

from pdserve.cluster.config import engine_config
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from tests.support.processes import rank_pids, replica_pids
from tests.support.streams import kill_under_streams
from tests.support.waiting import wait_for

if TYPE_CHECKING:
    from tests.support.ray_serve import ServedApps

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP = "tp2"
MAX_TOKENS = 12


def conv(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Question {i}: where do the ferries go? " * (1 + i)}]


@pytest.fixture(scope="module")
def tp_app(ray_serve: ServedApps, tiny_checkpoints: dict[str, str]) -> Iterator[str]:
    from tests.support.ray_serve import app_config

    raw = app_config(tiny_checkpoints["llama"], "colocated")
    raw["roles"]["decode"]["tensor_parallel_size"] = 2
    raw["roles"]["decode"]["collective_timeout_s"] = 20
    with ray_serve.deploy(APP, raw) as url:
        yield url


@pytest.fixture(scope="module")
def greedy(tiny_checkpoints: dict[str, str]) -> dict[int, str]:
    """One rank's greedy answers, in this process."""
    engine = LLMEngine(engine_config(tiny_checkpoints["llama"], num_kv_blocks=256))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    out = {}
    for i in range(8):
        ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(conv(i)))
        out[i] = engine.tokenizer.decode(engine.generate([ids], params)[0])
    return out


def chat(url: str, i: int, max_tokens: int = MAX_TOKENS) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": conv(i), "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})


def health(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0


def test_two_ranks_answer_as_one_rank_does(ray_serve: ServedApps, tp_app: str,
                                           greedy: dict[int, str]) -> None:
    wait_for(lambda: health(tp_app) == 200, 60, "the app to be healthy")
    assert len(replica_pids(APP, "decode")) == 1 and len(rank_pids()) == 1
    with ThreadPoolExecutor(max_workers=4) as pool:  # batched steps of several requests
        answers = list(pool.map(lambda i: chat(tp_app, i), range(8)))
    for i, r in enumerate(answers):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == greedy[i]
    ray_serve.wait_all_free(APP)


def test_a_killed_rank_fails_its_replica_cleanly_and_serve_replaces_it(
        ray_serve: ServedApps, tp_app: str, greedy: dict[int, str]) -> None:
    wait_for(lambda: health(tp_app) == 200, 60, "the app to be healthy")
    [replica_pid] = replica_pids(APP, "decode")
    [rank_pid] = rank_pids()
    bodies = [{"model": "tiny", "messages": conv(i), "max_tokens": 2000, "temperature": 0,
               "ignore_eos": True, "stream": True}
              for i in range(3)]
    for error in kill_under_streams(tp_app, bodies, rank_pid):
        assert error == {"message": "the worker serving this request stopped; retry it",
                         "type": "server_error", "param": None, "code": "service_unavailable"}
    wait_for(lambda: replica_pids(APP, "decode") not in ([], [replica_pid])
             and len(rank_pids()) == 1 and rank_pid not in rank_pids(), 120,
             "Serve to replace the replica and its rank")
    wait_for(lambda: health(tp_app) == 200, 60, "the app to be healthy again")
    r = chat(tp_app, 3)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == greedy[3]
    ray_serve.wait_all_free(APP)
