"""OpenAI logprobs shapes from engine logprobs: token text and exact bytes, top alternatives,
the legacy completions lists and their text offsets across stream chunks."""

from __future__ import annotations

import math

import pytest

from pdserve.engine.logprobs import TokenLogprobs
from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.logprobs import LogprobsFormatter


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoints: dict[str, str]) -> Tokenizer:
    return Tokenizer.from_checkpoint(tiny_checkpoints["llama"])


def entries(tokenizer: Tokenizer, text: str, top: int) -> list[TokenLogprobs]:
    """Made-up greedy logprobs for the tokens of ``text``; the alternatives are the next ids,
    each less likely."""
    return [TokenLogprobs(i, -0.5 * n, [(i + k, -0.5 * n - k) for k in range(top)])
            for n, i in enumerate(tokenizer.encode(text))]


def test_chat_entries_carry_exact_bytes_and_alternatives(tokenizer: Tokenizer) -> None:
    text = "crème 🙂 ok"
    given = entries(tokenizer, text, top=3)
    content = LogprobsFormatter(tokenizer).chat(given).content
    assert content is not None and len(content) == len(given)
    assert bytes(b for entry in content for b in entry.bytes or []) == text.encode()
    # A token holding part of a character renders as U+FFFD; its bytes stay exact.
    assert any(entry.token == "\ufffd" for entry in content)
    for entry, source in zip(content, given, strict=True):
        assert entry.logprob == source.logprob
        assert [t.logprob for t in entry.top_logprobs] == [lp for _, lp in source.top]
        assert entry.top_logprobs[0].bytes == entry.bytes


def test_completion_lists_line_up_and_offsets_continue_across_chunks(tokenizer: Tokenizer) -> None:
    given = entries(tokenizer, "Hello there, general Kenobi", top=2)
    formatter = LogprobsFormatter(tokenizer)
    first, second = formatter.completion(given[:3]), formatter.completion(given[3:])
    tokens = first.tokens + second.tokens
    assert "".join(tokens) == "Hello there, general Kenobi"
    offsets = first.text_offset + second.text_offset
    assert offsets == [sum(len(t) for t in tokens[:n]) for n in range(len(tokens))]
    assert first.token_logprobs + second.token_logprobs == [e.logprob for e in given]
    for top, entry in zip(first.top_logprobs + second.top_logprobs, given, strict=True):
        assert top is not None and len(top) == 2
        assert math.isclose(max(top.values()), entry.logprob)


def test_no_alternatives_asked_gives_empty_chat_tops_and_null_completion_tops(
        tokenizer: Tokenizer) -> None:
    given = [TokenLogprobs(i, -1.0, []) for i in tokenizer.encode("hi")]
    assert all(e.top_logprobs == [] for e in LogprobsFormatter(tokenizer).chat(given).content)
    assert LogprobsFormatter(tokenizer).completion(given).top_logprobs == [None] * len(given)
