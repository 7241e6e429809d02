"""pdserve over real HTTP on a real local Ray: the OpenAI API, parity, load, cancellation,
bad input, prefix reuse and metrics, for the disaggregated and the colocated app."""

from __future__ import annotations

import json
import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import httpx
import pytest

from pdserve.cluster.config import engine_config
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from tests.support.chat_cluster import MAX_TOKENS, SHARED_SYSTEM, chat, client, conversations
from tests.support.metrics import metric_value
from tests.support.waiting import wait_for

if TYPE_CHECKING:
    from tests.support.ray_serve import ServedApps

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def reference(tiny_checkpoints: dict[str, str]) -> dict[str, tuple[str, int, int]]:
    """Greedy text, prompt and output token counts from one in-process engine."""
    engine = LLMEngine(engine_config(tiny_checkpoints["llama"], num_kv_blocks=512))
    out = {}
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for conv in conversations():
        ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(conv))
        [tokens] = engine.generate([ids], params)
        out[json.dumps(conv)] = (engine.tokenizer.decode(tokens), len(ids), len(tokens))
    return out


@pytest.mark.parametrize("app", ["disagg", "colo"])
@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_parity_and_usage(served_apps: ServedApps, reference, app: str,
                                        stream: bool) -> None:
    landed_before, ready_before = decode_handoff_counts(app)
    for conv in conversations():
        text, usage = chat(served_apps, app, conv, stream)
        want_text, num_prompt, num_output = reference[json.dumps(conv)]
        assert text == want_text
        assert usage.prompt_tokens == num_prompt
        assert usage.completion_tokens == num_output == MAX_TOKENS
        assert usage.total_tokens == num_prompt + num_output
    served_apps.wait_all_free(app)
    if app == "disagg":  # long prompts: their KV crossed over as verified, landed pieces
        landed, ready = decode_handoff_counts(app)
        assert landed > landed_before and ready > ready_before


@pytest.mark.parametrize("app", ["disagg", "colo"])
def test_penalties_and_logit_bias_apply_on_both_workers(served_apps: ServedApps, reference,
                                                        tiny_checkpoints, app: str) -> None:
    """A negative frequency penalty (the tiny model's greedy text changes with it) gives the
    in-process engine's text; a +100 bias forces its token from the first one on, which the
    prefill worker samples on the disaggregated path."""
    engine = LLMEngine(engine_config(tiny_checkpoints["llama"], num_kv_blocks=128))
    c = client(served_apps, app)
    forced = engine.tokenizer.encode(" ok")[0]
    for conv in conversations()[:2]:
        ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(conv))
        [want] = engine.generate([ids], SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, frequency_penalty=-2.0))
        penalized = c.chat.completions.create(
            model="tiny", messages=conv, max_tokens=MAX_TOKENS, temperature=0,
            frequency_penalty=-2.0, extra_body={"ignore_eos": True})
        assert penalized.choices[0].message.content == engine.tokenizer.decode(want)
        assert penalized.choices[0].message.content != reference[json.dumps(conv)][0]
        biased = c.chat.completions.create(
            model="tiny", messages=conv, max_tokens=4, temperature=0.7, seed=1,
            logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
        assert biased.choices[0].message.content == engine.tokenizer.decode([forced] * 4)
    served_apps.wait_all_free(app)


# How far apart (in token ids) a draw moved by rounding may land: the tokens between the two
# hold next to no probability (measured: 3 ids at most, `benchmarks/seed_stability.py`).
NEIGHBOURS = 16


def assert_seeded_draws(tokenizer: Tokenizer, want: list[int], served: list[bytes]) -> bool:
    """The served tokens (their bytes) are the engine's draws for the same seed: equal, or
    equal up to a token near the engine's token in the vocabulary, after which the texts
    part. A row's logits differ in the last float bits with the batch around it (padded
    decode groups, chunks in the same step), and a draw that falls within that of the
    boundary between two tokens takes the next token that holds any probability
    (`engine/sampler.py`). A wrong seed, draw index or KV lands that close with probability
    32/1,024 per choice, and would miss in every choice. True: all equal."""
    assert len(served) == len(want)
    for k, (got, token) in enumerate(zip(served, want, strict=True)):
        if got != tokenizer.token_bytes(token):
            ids = range(max(0, token - NEIGHBOURS),
                        min(tokenizer.vocab_size, token + NEIGHBOURS + 1))
            assert got in {tokenizer.token_bytes(t) for t in ids if t != token}, (k, got, token)
            return False
    return True


@pytest.mark.parametrize("app", ["disagg", "colo"])
def test_n_choices_each_reproduce_their_seed_streamed_or_not(served_apps: ServedApps,
                                                              tiny_checkpoints, app: str) -> None:
    """n=3 sampled choices of a long (disaggregated) conversation no earlier request had:
    choice i is the engine's generation with seed 7+i, the later choices found the first
    one's prompt KV cached, and the stream interleaves the same three choices by index."""
    engine = LLMEngine(engine_config(tiny_checkpoints["llama"], num_kv_blocks=128))
    # Short enough (~180 tokens) that three prefills started together share the prefill
    # worker's steps (512 tokens each): none could reuse another's KV (measured: 0 cached).
    conv = [{"role": "system", "content": f"Request {uuid.uuid4()}. {SHARED_SYSTEM[:200]}"},
            {"role": "user", "content": "Three takes, please."}]
    ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(conv))
    want = engine.generate([ids] * 3, [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=7 + i, ignore_eos=True)
        for i in range(3)])
    assert len({tuple(w) for w in want}) == 3  # else the seeds would prove nothing
    c = client(served_apps, app)
    kwargs = dict(model="tiny", messages=conv, max_tokens=MAX_TOKENS, temperature=1.0, seed=7,
                  n=3, logprobs=True, extra_body={"ignore_eos": True})
    resp = c.chat.completions.create(**kwargs)
    assert [ch.index for ch in resp.choices] == [0, 1, 2]
    for choice, tokens in zip(resp.choices, want, strict=True):
        served = [bytes(t.bytes) for t in choice.logprobs.content]
        if assert_seeded_draws(engine.tokenizer, tokens, served):
            assert choice.message.content == engine.tokenizer.decode(tokens)
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.usage.completion_tokens == 3 * MAX_TOKENS
    assert resp.usage.prompt_tokens_details.cached_tokens >= 16 * (len(ids) // 16) - 16 > 0
    streamed: list[list[bytes]] = [[], [], []]
    texts, finished, usage = ["", "", ""], [], None
    for chunk in c.chat.completions.create(**kwargs, stream=True,
                                           stream_options={"include_usage": True}):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            content = choice.logprobs.content if choice.logprobs else None
            streamed[choice.index] += [bytes(t.bytes) for t in content or []]
            if choice.finish_reason:
                finished.append((choice.index, choice.finish_reason))
        usage = chunk.usage or usage
    for tokens, served, text in zip(want, streamed, texts, strict=True):
        if assert_seeded_draws(engine.tokenizer, tokens, served):
            assert text == engine.tokenizer.decode(tokens)
    assert sorted(finished) == [(0, "length"), (1, "length"), (2, "length")]
    assert usage is not None and usage.completion_tokens == 3 * MAX_TOKENS
    served_apps.wait_all_free(app)


def decode_handoff_counts(app: str) -> tuple[int, int]:
    """(pieces landed in decode's blocks, transfers ready) so far."""
    from ray import serve

    handle = serve.get_deployment_handle("decode", app_name=app)
    stats = handle.handoff_stats.remote().result(timeout_s=30)
    return stats.get("num_landed_pieces", 0), stats.get("num_ready", 0)


def test_httpx_completions_with_token_ids(served_apps: ServedApps, tiny_checkpoints) -> None:
    engine = LLMEngine(engine_config(tiny_checkpoints["llama"], num_kv_blocks=128))
    prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog " * 4)
    [tokens] = engine.generate([prompt], SamplingParams(max_tokens=9, temperature=0.0,
                                                          ignore_eos=True))
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 9, "temperature": 0,
            "ignore_eos": True}
    r = httpx.post(f"{served_apps.url('disagg')}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["object"] == "text_completion"
    assert data["choices"][0]["text"] == engine.tokenizer.decode(tokens)
    assert data["usage"]["prompt_tokens"] == len(prompt)
    assert data["choices"][0]["finish_reason"] == "length"


def test_32_concurrent_streams_complete_and_release_blocks(served_apps: ServedApps,
                                                           reference) -> None:
    convs = conversations() * 4
    with ThreadPoolExecutor(max_workers=32) as pool:
        results = list(pool.map(lambda conv: chat(served_apps, "disagg", conv, True), convs))
    for conv, (text, usage) in zip(convs, results, strict=True):
        assert text == reference[json.dumps(conv)][0]
        assert usage.completion_tokens == MAX_TOKENS
    served_apps.wait_all_free("disagg")


@pytest.mark.parametrize(("app", "n"), [("disagg", 1), ("colo", 1), ("disagg", 3)])
def test_client_disconnect_mid_stream_releases_blocks(served_apps: ServedApps, app: str,
                                                      n: int) -> None:
    before = served_apps.kv_stats(app)["decode"]["num_aborted"]
    body = {"model": "tiny", "stream": True, "max_tokens": 1500, "temperature": 0, "n": n,
            "ignore_eos": True, "messages": [{"role": "user", "content": SHARED_SYSTEM}]}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{served_apps.url(app)}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            chunks = 0
            for line in r.iter_lines():
                chunks += line.startswith("data:")
                if chunks >= 4:
                    break  # leave mid-stream: closing the response drops the connection
    served_apps.wait_all_free(app)
    # The decode engine aborted every choice, rather than running them to 1500 tokens.
    assert served_apps.kv_stats(app)["decode"]["num_aborted"] == before + n


BAD_BODIES = [
    (b"{not json", 400),
    (json.dumps({"model": "tiny"}).encode(), 400),  # missing messages
    (json.dumps({"model": "tiny", "messages": "hello"}).encode(), 400),  # wrong type
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                 "max_tokens": 0}).encode(), 400),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                 "max_tokens": 10**6}).encode(), 400),  # beyond the model limit
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "word " * 5000}]}
                ).encode(), 400),  # prompt longer than the context
    (json.dumps({"model": "gpt-unknown", "messages": [{"role": "user", "content": "x"}]}
                ).encode(), 404),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 17}
                ).encode(), 400),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                 "logit_bias": {"999999": 5}}).encode(), 400),  # beyond the vocabulary (engine)
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                 "stop_token_ids": [999999]}).encode(), 400),  # beyond the vocabulary (engine)
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                 "stream_options": {"include_usage": True}}).encode(), 400),  # without stream
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                 "response_format": {"type": "json_schema", "json_schema": {
                     "name": "bad", "schema": {"type": "nonsense"}}}}).encode(), 400),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                 "max_token": 4}).encode(), 400),  # an unknown field
]


@pytest.mark.parametrize(("body", "status"), BAD_BODIES)
def test_bad_input_gets_openai_error_and_server_keeps_serving(served_apps: ServedApps, body: bytes,
                                                              status: int) -> None:
    url = f"{served_apps.url('disagg')}/v1/chat/completions"
    r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]
    still_there = [{"role": "user", "content": "still there?"}]
    ok = httpx.post(url, json={"model": "tiny", "max_tokens": 2, "messages": still_there},
                    timeout=60)
    assert ok.status_code == 200


def test_prompt_too_long_message_names_both_numbers(served_apps: ServedApps) -> None:
    r = httpx.post(f"{served_apps.url('disagg')}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "word " * 5000}]})
    assert r.status_code == 400
    numbers = [int(n) for n in re.findall(r"\d+", r.json()["error"]["message"])]
    assert len([n for n in numbers if n > 1000]) >= 2


def test_repeated_prefix_hits_cache_and_metrics(served_apps: ServedApps) -> None:
    url = served_apps.url("disagg")
    # Unique at the start: no earlier test can have cached any of this prompt's blocks.
    conv = [{"role": "system", "content": "Preamble 42, unlike any other. " + SHARED_SYSTEM},
            {"role": "user", "content": "first question"}]
    before = httpx.get(f"{url}/metrics", timeout=30).text
    c = client(served_apps, "disagg")
    first = c.chat.completions.create(model="tiny", messages=conv, max_tokens=2)
    conv[1]["content"] = "second question"
    second = c.chat.completions.create(model="tiny", messages=conv, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    hit = second.usage.prompt_tokens_details.cached_tokens
    assert hit >= 16 * ((first.usage.prompt_tokens - 8) // 16) - 16 > 0
    after = httpx.get(f"{url}/metrics", timeout=30).text
    assert metric_value(after, "pdserve:prefix_hit_tokens_total") - metric_value(
        before, "pdserve:prefix_hit_tokens_total") >= hit
    computed = metric_value(after, "pdserve:prefill_tokens_computed_total") - metric_value(
        before, "pdserve:prefill_tokens_computed_total")
    assert computed == first.usage.prompt_tokens + second.usage.prompt_tokens - hit


def test_second_turn_sends_only_the_kv_decode_does_not_hold(served_apps: ServedApps,
                                                            tiny_checkpoints) -> None:
    """Turn 2 repeats turn 1's conversation: the decode worker still caches its prompt, so
    the handoff carries only the blocks after it, and the answer is still the engine's."""
    engine = LLMEngine(engine_config(tiny_checkpoints["llama"], num_kv_blocks=128))
    url, c = served_apps.url("disagg"), client(served_apps, "disagg")
    conv = [{"role": "system", "content": f"Session {uuid.uuid4()}. {SHARED_SYSTEM}"},
            {"role": "user", "content": "First question, please."}]
    sent = []
    for turn in range(2):
        ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(conv))
        [want] = engine.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                       ignore_eos=True))
        before = metric_value(httpx.get(f"{url}/metrics", timeout=30).text,
                              "pdserve:handoff_bytes_sum")
        reply = c.chat.completions.create(model="tiny", messages=conv, max_tokens=MAX_TOKENS,
                                          temperature=0, extra_body={"ignore_eos": True})
        assert reply.choices[0].message.content == engine.tokenizer.decode(want)
        sent.append(metric_value(httpx.get(f"{url}/metrics", timeout=30).text,
                                 "pdserve:handoff_bytes_sum") - before)
        conv += [{"role": "assistant", "content": reply.choices[0].message.content},
                 {"role": "user", "content": f"Follow-up number {turn + 1}?"}]
    prompt_blocks = len(ids) // 16 + 1
    assert 0 < sent[1] <= sent[0] * 8 / prompt_blocks  # a few blocks, not the whole prompt
    served_apps.wait_all_free("disagg")


def test_metrics_endpoint_serves_stage_histograms(served_apps: ServedApps) -> None:
    chat(served_apps, "disagg", conversations()[1], stream=False)
    text = httpx.get(f"{served_apps.url('disagg')}/metrics", timeout=30).text
    for name in ("pdserve:time_to_first_token_seconds_bucket",
                 "pdserve:request_time_per_output_token_seconds_bucket",
                 "pdserve:inter_token_latency_seconds_bucket",
                 "pdserve:prefill_compute_seconds_bucket", "pdserve:handoff_seconds_bucket",
                 "pdserve:tokenize_seconds_bucket", "pdserve:decode_reserve_seconds_bucket",
                 "pdserve:handoff_bytes_bucket", "pdserve:handoff_exposed_seconds_bucket"):
        assert metric_value(text, name) > 0, name
    assert 'path="disaggregated"' in text

    def role_gauges_shown() -> bool:  # as the ingress last heard them from each replica
        text = httpx.get(f"{served_apps.url('disagg')}/metrics", timeout=30).text
        lines = [line for line in text.splitlines() if not line.startswith("#")]
        return all(any(line.startswith(f"pdserve:{gauge}{{") and f'role="{role}"' in line
                       for line in lines)
                   for role in ("decode", "prefill")
                   for gauge in ("kv_cache_usage_perc", "num_requests_running",
                                 "num_requests_waiting"))

    wait_for(role_gauges_shown, 10, "per-role gauges in /metrics")


def test_models_and_health(served_apps: ServedApps) -> None:
    models = client(served_apps, "disagg").models.list()
    assert [m.id for m in models.data] == ["tiny"]
    for app, roles in (("colo", {"decode": 1}), ("disagg", {"decode": 1, "prefill": 1})):
        r = httpx.get(f"{served_apps.url(app)}/health", timeout=30)
        assert r.status_code == 200 and r.json() == {"status": "ok", "replicas": roles}


def test_admission_limit_answers_429_with_retry_after(served_apps: ServedApps) -> None:
    """The colocated app admits 4 requests at once; a burst of 10 gets some 429s, and the
    admitted ones still finish correctly."""
    url = f"{served_apps.url('colo')}/v1/chat/completions"
    body = {"model": "tiny", "stream": True, "max_tokens": 300, "temperature": 0,
            "ignore_eos": True, "messages": [{"role": "user", "content": "count slowly"}]}

    def one(_: int) -> tuple[int, str | None, int]:
        with httpx.Client(timeout=120) as http, http.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                r.read()
                assert r.json()["error"]["message"]
                return r.status_code, r.headers.get("retry-after"), 0
            data = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
            finished = any('"finish_reason":"length"' in d.replace(" ", "") for d in data)
            return 200, None, int(data[-1] == "[DONE]" and finished)

    with ThreadPoolExecutor(max_workers=10) as pool:
        results = list(pool.map(one, range(10)))
    rejected = [r for r in results if r[0] == 429]
    admitted = [r for r in results if r[0] == 200]
    assert rejected and all(float(retry) >= 1 for _, retry, _ in rejected)
    assert len(admitted) >= 4
    # Every admitted stream ran to its 300 tokens and closed properly.
    assert all(complete for _, _, complete in admitted)
    served_apps.wait_all_free("colo")
