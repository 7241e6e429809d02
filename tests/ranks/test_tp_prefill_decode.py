"""A prefill replica of two tensor-parallel ranks into a decode replica of two, over real
HTTP, UCXX and Ray Serve: each prefill rank sends the KV head it holds straight into the
decode rank that holds it; greedy answers equal one rank's, and a prompt whose prefix decode
still caches moves only the blocks after it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import httpx
import pytest

from pdserve.cluster.config import engine_config
from pdserve.engine.engine import LLMEngine
from tests.support.processes import rank_pids
from tests.support.tp_reuse import check_greedy_and_prefix_reuse
from tests.support.waiting import wait_for

if TYPE_CHECKING:
    from tests.support.ray_serve import ServedApps

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP = "tp_prefill_decode"


@pytest.fixture(scope="module")
def tp_app(ray_serve: ServedApps, tiny_checkpoints: dict[str, str]) -> Iterator[str]:
    from tests.support.ray_serve import app_config

    raw = app_config(tiny_checkpoints["llama"], "disaggregated")
    raw["roles"]["prefill"]["tensor_parallel_size"] = 2
    raw["roles"]["decode"]["tensor_parallel_size"] = 2
    with ray_serve.deploy(APP, raw) as url:
        yield url


def test_prefill_two_ranks_to_decode_two_ranks_greedy_and_prefix_reuse(
        ray_serve: ServedApps, tp_app: str, tiny_checkpoints: dict[str, str]) -> None:
    engine = LLMEngine(engine_config(tiny_checkpoints["llama"], num_kv_blocks=256))
    wait_for(lambda: httpx.get(f"{tp_app}/health", timeout=5).status_code == 200, 60,
             "the app to be healthy")
    assert len(rank_pids()) == 2  # prefill's rank 1 and decode's
    check_greedy_and_prefix_reuse(tp_app, engine)
    ray_serve.wait_all_free(APP)
