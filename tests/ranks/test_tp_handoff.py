"""The KV handoff into a decode replica of two tensor-parallel ranks, over real HTTP, UCXX and
Ray Serve: the prefill replica (one rank) sends each decode rank the KV heads it holds, the
decode replica admits a request once both routes' fences verified, greedy answers equal one
rank's, and a prompt whose prefix decode still caches moves only the blocks after it. Decode
rank 1 killed by the OS mid-stream: every stream ends (an error event), the prefill replica
gets every block back, Serve replaces the decode replica, and answers are right again."""

from __future__ import annotations

import json
import os
import signal
import threading
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from pdserve.cluster.config import engine_config
from pdserve.engine.engine import LLMEngine
from pdserve.engine.kv_cache import kv_bytes_per_token
from pdserve.engine.sampling_params import SamplingParams
from tests.support.processes import rank_pids, replica_pids
from tests.support.waiting import wait_for

if TYPE_CHECKING:
    from tests.support.ray_serve import ServedApps

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP = "tp_handoff"
MAX_TOKENS = 10
BLOCK_SIZE = 16
SYSTEM = ("You answer questions about the harbour timetable: ferries, tides, moorings and the "
          "fuel dock, quoting the notice board word for word. ") * 3


@pytest.fixture(scope="module")
def tp_app(ray_serve: ServedApps, tiny_checkpoints: dict[str, str]) -> Iterator[str]:
    from tests.support.ray_serve import app_config

    raw = app_config(tiny_checkpoints["llama"], "disaggregated")
    raw["roles"]["decode"]["tensor_parallel_size"] = 2
    with ray_serve.deploy(APP, raw) as url:
        yield url


@pytest.fixture(scope="module")
def engine(tiny_checkpoints: dict[str, str]) -> LLMEngine:
    """One rank, in this process: the reference answers and token counts."""
    return LLMEngine(engine_config(tiny_checkpoints["llama"], num_kv_blocks=256))


def chat(url: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "pdserve_timings": True})
    assert r.status_code == 200, r.text
    return r.json()


def reference(engine: LLMEngine, messages: list[dict[str, str]]) -> tuple[str, list[int]]:
    ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return engine.tokenizer.decode(engine.generate([ids], params)[0]), ids


def num_blocks(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


def test_prefill_one_rank_to_decode_two_ranks_greedy_and_prefix_reuse(
        ray_serve: ServedApps, tp_app: str, engine: LLMEngine) -> None:
    wait_for(lambda: httpx.get(f"{tp_app}/health", timeout=5).status_code == 200, 60,
             "the app to be healthy")
    system = f"Session {uuid.uuid4()}. {SYSTEM}"  # nothing of it cached anywhere yet
    first = [{"role": "system", "content": system}, {"role": "user", "content": "When is "
                                                                              "high tide?"}]
    second = [{"role": "system", "content": system}, {"role": "user", "content": "Where is "
                                                                               "the fuel dock?"}]
    sent = []
    for messages in (first, second):
        want, ids = reference(engine, messages)
        body = chat(tp_app, messages)
        assert body["choices"][0]["message"]["content"] == want
        [t] = body["pdserve_timings"]
        assert t["path"] == "disaggregated", (t["fallback_reason"], t["handoff_error"])
        sent.append((t["handoff_bytes"], ids))
    (bytes_1, ids_1), (bytes_2, ids_2) = sent
    # Every KV head of every block: each decode rank's half of them arrived.
    per_block = kv_bytes_per_token(engine.loaded.config, engine.config.dtype) * BLOCK_SIZE
    assert bytes_1 == per_block * num_blocks(len(ids_1))  # decode held none of turn 1's prompt
    common = next(i for i, (a, b) in enumerate(zip(ids_1, ids_2, strict=False)) if a != b)
    cached_blocks = common // BLOCK_SIZE  # decode's cached prefix: the shared whole blocks
    assert cached_blocks >= 4
    assert bytes_2 == per_block * (num_blocks(len(ids_2)) - cached_blocks)
    ray_serve.wait_all_free(APP)


def test_a_killed_decode_rank_ends_its_streams_and_prefill_gets_its_blocks_back(
        ray_serve: ServedApps, tp_app: str, engine: LLMEngine) -> None:
    wait_for(lambda: httpx.get(f"{tp_app}/health", timeout=5).status_code == 200, 60,
             "the app to be healthy")
    [decode_pid] = replica_pids(APP, "decode")
    [rank_pid] = rank_pids()
    events: dict[int, list[str]] = {i: [] for i in range(3)}
    started = threading.Barrier(4)

    def stream(i: int) -> None:
        body = {"model": "tiny", "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
                "stream": True, "messages": [{"role": "user", "content": f"{i} {SYSTEM}"}]}
        with httpx.stream("POST", f"{tp_app}/v1/chat/completions", json=body,
                          timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events[i].append(line[6:])
                    if len(events[i]) == 3:
                        started.wait(60)

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    started.wait(60)  # every prompt's KV arrived in both ranks: they are decoding
    os.kill(rank_pid, signal.SIGKILL)
    for t in threads:  # within the 120 s request timeout: nothing waits on the dead rank
        t.join(60)
        assert not t.is_alive()
    for i in range(3):
        assert events[i][-1] == "[DONE]", events[i][-3:]
        assert json.loads(events[i][-2])["error"]["code"] == "service_unavailable"
    wait_for(lambda: replica_pids(APP, "decode") not in ([], [decode_pid])
             and len(rank_pids()) == 1 and rank_pid not in rank_pids(), 120,
             "Serve to replace the decode replica and its rank")
    wait_for(lambda: httpx.get(f"{tp_app}/health", timeout=5).status_code == 200, 60,
             "the app to be healthy again")
    messages = [{"role": "user", "content": f"After the restart. {SYSTEM}"}]
    want, _ = reference(engine, messages)
    body = chat(tp_app, messages)
    assert body["choices"][0]["message"]["content"] == want
    assert body["pdserve_timings"][0]["path"] == "disaggregated"
    ray_serve.wait_all_free(APP)  # the prefill replica's blocks too
