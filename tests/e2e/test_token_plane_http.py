"""Tokens over the token plane, through real HTTP on a real local Ray: streamed, whole and
in-process answers agree token for token at 1, 32 and 64 concurrent streams; one frame per
engine step reaches the ingress, and a request's Serve calls carry a few lifecycle messages
whatever its length; the live plane refuses a peer without the cluster's token."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from pdserve.cluster.config import engine_config
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.planes.token_wire import TOKEN_PLANE
from pdserve.router.sse import split_sse_data

if TYPE_CHECKING:
    from tests.support.ray_serve import ServedApps

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP = "planes"
MAX_TOKENS = 24


def prompt(i: int) -> list[int]:
    """Token-id prompts: half short (prefilled on decode), half long (disaggregated)."""
    length = 8 + i % 5 if i % 2 else 40 + 3 * (i % 7)
    return [3 + (i * 7 + j * 13) % 250 for j in range(length)]


@pytest.fixture(scope="module")
def colocated(ray_serve: ServedApps, tiny_checkpoints: dict[str, str]) -> str:
    """A colocated app admitting 64 requests at once (the session's `colo` admits 4)."""
    from tests.support.ray_serve import app_config

    with ray_serve.deploy(APP, app_config(tiny_checkpoints["llama"], "colocated",
                                          max_in_flight_requests=96)) as url:
        yield url


@pytest.fixture(scope="module")
def greedy(tiny_checkpoints: dict[str, str]) -> dict[int, list[int]]:
    engine = LLMEngine(engine_config(tiny_checkpoints["llama"], num_kv_blocks=512))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = engine.generate([prompt(i) for i in range(64)], params)
    return dict(enumerate(outputs))


def complete(url: str, i: int, stream: bool, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    """One greedy completion of ``prompt(i)``: its text, token count and stage timings."""
    body = {"model": "tiny", "prompt": prompt(i), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream, "pdserve_timings": True, "logprobs": 1}
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    if not stream:
        data = r.json()
        return {"text": data["choices"][0]["text"],
                "tokens": data["choices"][0]["logprobs"]["tokens"],
                "usage": data["usage"], "timings": data["pdserve_timings"][0]}
    payloads = split_sse_data(r.text)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    tokens = [t for c in chunks if c.get("choices") and c["choices"][0]["logprobs"]
              for t in c["choices"][0]["logprobs"]["tokens"]]
    usage = next(c["usage"] for c in chunks if c.get("usage"))
    timings = next(c["pdserve_timings"] for c in chunks if "pdserve_timings" in c)[0]
    return {"text": text, "tokens": tokens, "usage": usage, "timings": timings}


@pytest.mark.parametrize("app", ["disagg", "planes"])
@pytest.mark.parametrize("concurrency", [1, 32, 64])
def test_streamed_whole_and_engine_agree_at_any_concurrency(
        served_apps: ServedApps, colocated: str, greedy: dict[int, list[int]],
        tiny_checkpoints: dict[str, str], app: str, concurrency: int) -> None:
    from pdserve.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_checkpoint(tiny_checkpoints["llama"])
    url = served_apps.url(app)
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        streamed = list(pool.map(lambda i: complete(url, i, True), range(concurrency)))
        whole = list(pool.map(lambda i: complete(url, i, False), range(concurrency)))
    for i in range(concurrency):
        want = tokenizer.decode(greedy[i])
        assert streamed[i]["text"] == whole[i]["text"] == want, i
        assert len(streamed[i]["tokens"]) == len(whole[i]["tokens"]) == MAX_TOKENS
        assert streamed[i]["usage"]["completion_tokens"] == MAX_TOKENS
    served_apps.wait_all_free(app)


def plane_stats(app: str) -> tuple[dict[str, Any], dict[str, Any]]:
    from ray import serve

    ingress = serve.get_deployment_handle("ingress", app_name=app)
    decode = serve.get_deployment_handle("decode", app_name=app)
    return (ingress.token_plane_stats.remote().result(timeout_s=30),
            decode.token_plane_stats.remote().result(timeout_s=30))


@pytest.mark.parametrize("app", ["disagg", "planes"])
def test_one_frame_per_step_and_a_few_serve_messages_per_request(
        served_apps: ServedApps, colocated: str, app: str) -> None:
    url = served_apps.url(app)
    served_apps.wait_all_free(app)
    ingress_before, decode_before = plane_stats(app)
    # Serve messages of each answer, by the path it took (under load some prompts are
    # prefilled on decode instead of on the prefill worker).
    messages: dict[int, list[tuple[str, int]]] = {}
    for length in (4, 96):
        with ThreadPoolExecutor(max_workers=32) as pool:
            runs = list(pool.map(lambda i, n=length: complete(url, i, True, n), range(32)))
        messages[length] = [(run["timings"]["path"], run["timings"]["num_serve_messages"])
                            for run in runs]
        assert all(run["usage"]["completion_tokens"] == length for run in runs)
    ingress_after, decode_after = plane_stats(app)
    steps = decode_after["num_engine_steps"] - decode_before["num_engine_steps"]
    frames = ingress_after["num_frames"] - ingress_before["num_frames"]
    entries = ingress_after["num_entries"] - ingress_before["num_entries"]
    # One ingress: at most one frame per engine step, each carrying many streams' tokens.
    assert 0 < frames <= steps
    assert entries > 4 * frames
    assert decode_after["num_frames"] - decode_before["num_frames"] == frames
    # Per path, however long the answer: a ticket and the KV's outcome when the KV is
    # handed off, nothing when decode prefills the prompt itself.
    per_path = {"disaggregated": 2, "local_prefill": 0, "colocated": 0}
    for path, count in messages[4] + messages[96]:
        assert count == per_path[path], (path, count)
    if app == "disagg":
        assert any(path == "disaggregated" for path, _ in messages[96])
    assert ingress_after["num_unknown_entries"] == ingress_before["num_unknown_entries"]


def test_the_live_token_plane_refuses_a_peer_without_the_cluster_token(
        served_apps: ServedApps) -> None:
    before, _ = plane_stats("disagg")

    async def intrude() -> None:
        reader, writer = await asyncio.open_connection(before["host"], before["port"])
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
            await TOKEN_PLANE.connect(reader, writer, "not-the-cluster-token-0123")
        writer.close()

    asyncio.run(intrude())
    after, _ = plane_stats("disagg")
    assert after["num_refused_connections"] == before["num_refused_connections"] + 1
    # ... and it keeps serving.
    assert complete(served_apps.url("disagg"), 1, True)["usage"]["completion_tokens"] == \
        MAX_TOKENS
