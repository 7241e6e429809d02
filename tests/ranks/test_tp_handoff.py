"""The KV handoff into a decode replica of two tensor-parallel ranks, over real HTTP, UCXX and
Ray Serve: the prefill replica (one rank) sends each decode rank the KV heads it holds, the
decode replica admits a request once both routes' fences verified, greedy answers equal one
rank's, and a prompt whose prefix decode still caches moves only the blocks after it. Decode
rank 1 killed by the OS mid-stream: every stream ends (an error event), the prefill replica
gets every block back, Serve replaces the decode replica, and answers are right again."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import httpx
import pytest

from pdserve.cluster.config import engine_config
from pdserve.engine.engine import LLMEngine
from tests.support.processes import rank_pids, replica_pids
from tests.support.streams import kill_under_streams
from tests.support.tp_reuse import SYSTEM, chat, check_greedy_and_prefix_reuse, reference
from tests.support.waiting import wait_for

if TYPE_CHECKING:
    from tests.support.ray_serve import ServedApps

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP = "tp_handoff"


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


def test_prefill_one_rank_to_decode_two_ranks_greedy_and_prefix_reuse(
        ray_serve: ServedApps, tp_app: str, engine: LLMEngine) -> None:
    wait_for(lambda: httpx.get(f"{tp_app}/health", timeout=5).status_code == 200, 60,
             "the app to be healthy")
    check_greedy_and_prefix_reuse(tp_app, engine)
    ray_serve.wait_all_free(APP)


def test_a_killed_decode_rank_ends_its_streams_and_prefill_gets_its_blocks_back(
        ray_serve: ServedApps, tp_app: str, engine: LLMEngine) -> None:
    wait_for(lambda: httpx.get(f"{tp_app}/health", timeout=5).status_code == 200, 60,
             "the app to be healthy")
    [decode_pid] = replica_pids(APP, "decode")
    [rank_pid] = rank_pids()
    bodies = [{"model": "tiny", "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
               "stream": True, "messages": [{"role": "user", "content": f"{i} {SYSTEM}"}]}
              for i in range(3)]
    # Once underway, every prompt's KV arrived in both ranks: they are decoding.
    for error in kill_under_streams(tp_app, bodies, rank_pid):
        assert error["code"] == "service_unavailable"
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
