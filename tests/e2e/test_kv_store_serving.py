"""The shared KV tier served for real: a Mooncake master this module starts, apps (one prefill
and one decode replica; one colocated replica) whose host tiers hold less than a document, so
a repeat loads its prefix from the store (greedy parity, cached tokens, the store's hits
counted, every tier of every role back to baseline); a prefill replica killed while its
requests load from the store loses no request and no decode block; its replacement serves."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from tests.support.kv_serving import (
    ask_each_twice,
    complete,
    greedy_completer,
    host_gb,
    random_documents,
    settled,
)
from tests.support.metrics import metric_value
from tests.support.processes import replica_pids
from tests.support.waiting import wait_for

pytest.importorskip("mooncake.store", reason="mooncake-transfer-engine is not installed "
                    "(pip install mooncake-transfer-engine-non-cuda)")

from pdserve.cluster.kv_store_master import StoreMaster, start_master, stop_master  # noqa: E402

if TYPE_CHECKING:
    from tests.support.ray_serve import ServedApps

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP = "kv-store"
MAX_TOKENS = 6
DEVICE_BLOCKS = 48  # 768 tokens per worker: a document is evicted two documents later
HOST_BLOCKS = 4  # less than a document's 18 full blocks: its first blocks leave it first
DOC_TOKENS = 300
NUM_DOCS = 4
# The tiny preset with wide layers and one KV head: computing a block costs many times
# loading its 16 KiB, so the worker's measured choice is a load (the tiny preset computes a
# document about as fast as this machine's busy store thread loads it).
WIDE = {"hidden_size": 512, "intermediate_size": 2048, "num_layers": 2, "num_heads": 8,
        "num_kv_heads": 1}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    from pdserve.engine.checkpoint_maker import make_checkpoint

    return str(make_checkpoint(tmp_path_factory.mktemp("wide") / "llama", "llama", "tiny",
                               shape=WIDE))


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreMaster]:
    started = start_master(log_path=Path(tmp_path_factory.mktemp("store")) / "master.log")
    yield started
    stop_master(started)


def store_app(served: ServedApps, path: str, master: StoreMaster, mode: str,
              name: str, load_policy: str) -> AbstractContextManager[str]:
    """An app of ``mode`` (one replica per role) whose host tiers hold less than a document,
    sharing the module's store; ``load_policy``: engine.kv_load_policy."""
    from tests.support.ray_serve import app_config

    raw = app_config(path, mode)
    raw["engine"] |= {"num_kv_blocks": DEVICE_BLOCKS,
                      "host_kv_cache_gb": host_gb(path, HOST_BLOCKS),
                      "kv_load_policy": load_policy}
    raw["kv_store"] = {"enabled": True, "master_address": master.rpc_address,
                       "metadata_server": master.metadata_server, "segment_mb": 16,
                       "staging_mb": 4}
    for role in raw["roles"]:
        raw["roles"][role]["resources"] = {"num_cpus": 0.5}
    return served.deploy(name, raw)


@pytest.fixture(scope="module")
def app(ray_serve: ServedApps, checkpoint: str, master: StoreMaster) -> Iterator[str]:
    # Loads whatever the timings say: the kill below needs a request loading from the store,
    # which a busy machine's measurements may price above computing (the colocated app
    # below keeps the measured choice).
    with store_app(ray_serve, checkpoint, master, "disaggregated", APP, "always") as url:
        yield url


def make_documents(path: str, seed: int) -> list[list[int]]:
    return random_documents(path, NUM_DOCS, DOC_TOKENS, seed)


@pytest.fixture(scope="module")
def documents(checkpoint: str) -> list[list[int]]:
    return make_documents(checkpoint, 11)


@pytest.fixture(scope="module")
def greedy(checkpoint: str) -> Iterator[Callable[[list[int]], str]]:
    with greedy_completer(checkpoint, MAX_TOKENS) as complete_greedily:
        yield complete_greedily


def check_repeats_load_from_the_store(served: ServedApps, app_name: str, url: str,
                                      documents: list[list[int]],
                                      greedy: Callable[[list[int]], str], role: str,
                                      always: bool) -> None:
    """Each document twice: every answer one engine's; the first repeat loads its prefix from
    the store on ``role`` (``always``: whatever the estimates say); the store's hits counted;
    every tier back to baseline."""
    # Between the rounds, every put done: the first documents are in the store, not the host.
    repeats = ask_each_twice(url, documents, greedy, MAX_TOKENS, lambda: wait_for(
        lambda: settled(served, app_name), 30, "the first round's puts"))
    # The first repeat's document left the device and its first blocks the host tier: the
    # store holds its prefix. The worker loads it when its estimate of the load (fitted on
    # its own store copies, the first round's puts among them) beats computing it: on a
    # quiet machine it does; on a busy one the puts' times can make computing cheaper.
    first = repeats[0]
    assert first["kv_tier"] == "store", repeats
    for timings in repeats:
        if timings["kv_tier"] == "store":
            load_ms, compute_ms = timings["kv_load_estimate_ms"], timings["kv_compute_estimate_ms"]
            chose_load = always or load_ms is None or compute_ms is None or load_ms < compute_ms
            assert timings["kv_load_choice"] == ("load" if chose_load else "recompute"), timings
    if first["kv_load_choice"] == "recompute":
        assert first["kv_load_estimate_ms"] >= first["kv_compute_estimate_ms"], first
    else:
        assert first["kv_loaded_tokens"] >= 16, first
        assert first["cached"] >= DOC_TOKENS - 16, first
        if role == "prefill":  # what the prefill worker computed (colocated: cached says it)
            assert first["prefill_tokens_computed"] <= 20, first
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert metric_value(metrics, "pdserve:prefix_cache_hits_total", 'tier="store"') >= \
            first["kv_loaded_tokens"]
        stats = served.kv_stats(app_name)[role]["tiers"]
        assert stats["num_store_loads"] >= 1, stats
    for timings in repeats:  # loaded or computed, never a wrong answer (checked above)
        assert timings["kv_tier"] in (None, "store", "host"), timings
    assert served.kv_stats(app_name)[role]["tiers"]["num_store_puts"] > 0
    wait_for(lambda: settled(served, app_name), 30, "every tier of every role at baseline")


def test_a_repeat_loads_its_prefix_from_the_store_disaggregated(
        ray_serve: ServedApps, app: str, documents: list[list[int]],
        greedy: Callable[[list[int]], str]) -> None:
    check_repeats_load_from_the_store(ray_serve, APP, app, documents, greedy, "prefill", True)


def test_a_repeat_loads_its_prefix_from_the_store_colocated(
        ray_serve: ServedApps, checkpoint: str, master: StoreMaster,
        greedy: Callable[[list[int]], str]) -> None:
    with store_app(ray_serve, checkpoint, master, "colocated", "kv-store-colo",
                   "measured") as url:
        # Documents of their own: the disaggregated app's blocks share the store and layout.
        check_repeats_load_from_the_store(ray_serve, "kv-store-colo", url,
                                          make_documents(checkpoint, 12), greedy, "decode",
                                          False)


def test_a_prefill_replica_killed_mid_load_loses_no_request_and_no_decode_block(
        ray_serve: ServedApps, app: str, documents: list[list[int]],
        greedy: Callable[[list[int]], str]) -> None:
    from ray import serve

    wait_for(lambda: settled(ray_serve, APP), 30, "the app at baseline")
    # Each document once, in order: the first ones leave prefill's device and host tiers
    # and live on in the store (as after the tests above, which this one does not need).
    for k, doc in enumerate(documents):
        assert send(app, doc + [8, 8, k])[0] == 200
    wait_for(lambda: settled(ray_serve, APP), 30, "the documents' blocks put in the store")
    [victim] = replica_pids(APP, "prefill")
    # The replica dies (SIGKILL) as the first copy from the store is submitted: a fault point,
    # for a store load of the tiny model can start and end between two polls of its stats.
    serve.get_deployment_handle("prefill", app_name=APP).arm_fault.remote(
        "prefill.loading_kv").result(timeout_s=30)
    prompts = [doc + [9, 9, k] for k, doc in enumerate(documents)] * 2
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        answers = list(pool.map(send, [app] * len(prompts), prompts, timeout=120))
    for ids, (status, text) in zip(prompts, answers, strict=True):
        # A right answer, or a clear error: never a wrong one, never a hang.
        assert (status == 200 and text == greedy(ids)) or (status >= 500 and text), (status,
                                                                                     text)
    assert sum(status == 200 for status, _ in answers) > 0, answers
    wait_for(lambda: settled_role("decode"), 30, "decode's blocks at baseline")
    wait_for(lambda: replica_pids(APP, "prefill") not in ([], [victim]), 90,
             "a replacement prefill replica (the armed one died loading)")
    wait_for(lambda: httpx.get(f"{app}/health", timeout=5).status_code == 200, 90,
             "the app healthy again")
    ids = documents[0] + [4, 4, 4]
    body = complete(app, ids, MAX_TOKENS)
    assert body["choices"][0]["text"] == greedy(ids)
    assert body["pdserve_timings"][0]["path"] == "disaggregated", body["pdserve_timings"]
    wait_for(lambda: settled(ray_serve, APP), 30, "every tier of every role at baseline")


def send(url: str, ids: list[int]) -> tuple[int, str]:
    try:
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True})
    except httpx.HTTPError as exc:
        return 0, repr(exc)
    if r.status_code != 200:
        return r.status_code, r.text
    return 200, r.json()["choices"][0]["text"]


def settled_role(role: str) -> bool:
    """One role's tiers at baseline, asked of that role alone (the other may be dead)."""
    from ray import serve

    s = serve.get_deployment_handle(role, app_name=APP).kv_stats.remote().result(timeout_s=30)
    return (s["num_free_blocks"] == s["num_blocks"] and s["num_loading"] == 0
            and s["tiers"]["num_host_busy_blocks"] == 0
            and s["tiers"]["num_store_pinned_blocks"] == 0)
