"""Greedy parity and decode-side prefix reuse over HTTP for apps whose replicas have several
tensor-parallel ranks: two prompts sharing a long system prompt, answers against one engine's.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx

from pdserve.engine.engine import LLMEngine
from pdserve.engine.kv.cache import kv_bytes_per_token
from pdserve.engine.sampling_params import SamplingParams

MAX_TOKENS = 10
BLOCK_SIZE = 16
SYSTEM = ("You answer questions about the harbour timetable: ferries, tides, moorings and the "
          "fuel dock, quoting the notice board word for word. ") * 3


def chat(url: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "pdserve_timings": True})
    assert r.status_code == 200, r.text
    return r.json()


def reference(engine: LLMEngine, messages: list[dict[str, str]]) -> tuple[str, list[int]]:
    """One rank's greedy answer to ``messages`` and its prompt's token ids."""
    ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return engine.tokenizer.decode(engine.generate([ids], params)[0]), ids


def num_blocks(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


def check_greedy_and_prefix_reuse(url: str, engine: LLMEngine) -> None:
    """Two disaggregated turns under a fresh system prompt answer as ``engine`` does; the
    first moves every KV head of every block, the second only the blocks after the whole
    blocks decode still caches of the first."""
    system = f"Session {uuid.uuid4()}. {SYSTEM}"  # nothing of it cached anywhere yet
    turns = [[{"role": "system", "content": system}, {"role": "user", "content": question}]
             for question in ("When is high tide?", "Where is the fuel dock?")]
    sent = []
    for messages in turns:
        want, ids = reference(engine, messages)
        body = chat(url, messages)
        assert body["choices"][0]["message"]["content"] == want
        [t] = body["pdserve_timings"]
        assert t["path"] == "disaggregated", (t["fallback_reason"], t["handoff_error"])
        sent.append((t["handoff_bytes"], ids))
    (bytes_1, ids_1), (bytes_2, ids_2) = sent
    per_block = kv_bytes_per_token(engine.loaded.config, engine.layout.dtype) * BLOCK_SIZE
    assert bytes_1 == per_block * num_blocks(len(ids_1))
    common = next(i for i, (a, b) in enumerate(zip(ids_1, ids_2, strict=False)) if a != b)
    cached_blocks = common // BLOCK_SIZE
    assert cached_blocks >= 4
    assert bytes_2 == per_block * (num_blocks(len(ids_2)) - cached_blocks)
