"""Our Tokenizer equals transformers' AutoTokenizer; streaming detokenization equals full decode.

Property tests cover random texts and random token sequences, multi-byte characters included.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello world",
    "",
    "  leading and trailing spaces  ",
    "今天早上下了一场小雨，空气特别清新。",
    "Emoji 🙂🎉👋🏽🇫🇷 and accents: crème brûlée, smørrebrød, Ångström",
    "def f(x: int) -> int:\n\treturn x ** 2  # comment\n",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "Сегодня утром шёл снег. مرحباً 안녕하세요",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "2+2? 🙂"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Und 3+3? 你好"},
    ],
]
# Any character except lone surrogates (not encodable) and U+FFFD itself (ambiguous in output).
TEXT_STRATEGY = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\ufffd"), max_size=40
)


@pytest.fixture(scope="module")
def path(tiny_checkpoints: dict[str, str]) -> str:
    return tiny_checkpoints["llama"]


@pytest.fixture(scope="module")
def ours(path: str) -> Tokenizer:
    return Tokenizer.from_checkpoint(path)


@pytest.fixture(scope="module")
def theirs(path: str):  # returns a transformers tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_encode_decode_match_transformers(
    ours: Tokenizer, theirs, text: str, add_special_tokens: bool
) -> None:
    ids = ours.encode(text, add_special_tokens=add_special_tokens)
    assert ids == theirs.encode(text, add_special_tokens=add_special_tokens)
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
            ids, skip_special_tokens=skip
        )


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    ours: Tokenizer, theirs, messages, add_generation_prompt: bool
) -> None:
    expected = theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert (
        ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    )


def test_special_ids_and_vocab(ours: Tokenizer, theirs) -> None:
    assert ours.vocab_size == len(theirs)
    assert ours.eos_token_ids == (
        theirs.convert_tokens_to_ids("<|im_end|>"),
        theirs.convert_tokens_to_ids("<|endoftext|>"),
    )
    assert ours.encode("<|im_start|>") == [ours.token_to_id("<|im_start|>")]


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=TEXT_STRATEGY)
def test_random_text_encodes_like_transformers_and_round_trips(
    ours: Tokenizer, theirs, text: str
) -> None:
    ids = ours.encode(text)
    assert ids == theirs.encode(text, add_special_tokens=False)
    # Byte-level BPE is lossless; text that spells a special token encodes to it (as in
    # transformers), and only decoding that keeps special tokens gives it back.
    assert ours.decode(ids, skip_special_tokens=False) == text


def stream(
    tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool = True
) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    pieces = [detok.add(i) for i in ids]
    pieces.append(detok.flush())
    assert detok.text == "".join(pieces)
    return pieces, detok.text


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=TEXT_STRATEGY)
def test_streaming_valid_text_never_emits_replacement_chars(ours: Tokenizer, text: str) -> None:
    # Special tokens kept: text that spells one ("<|endoftext|>") encodes to it, and the
    # default decoding drops it.
    pieces, full = stream(ours, ours.encode(text), skip_special_tokens=False)
    assert full == text
    assert not any("\ufffd" in piece for piece in pieces)


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ids=st.lists(st.integers(min_value=0, max_value=1023), max_size=40), skip=st.booleans())
def test_streaming_random_ids_equals_full_decode(
    ours: Tokenizer, ids: list[int], skip: bool
) -> None:
    _, full = stream(ours, ids, skip_special_tokens=skip)
    assert full == ours.decode(ids, skip_special_tokens=skip)


def test_multibyte_character_split_across_tokens_is_held_back(ours: Tokenizer) -> None:
    # Find characters whose UTF-8 bytes the tokenizer splits over several tokens.
    candidates = "今天早上下了一场小雨🙂🎉👋🏽한국어"
    split = [ch for ch in candidates if len(ours.encode(ch)) > 1]
    assert split, "expected the tiny vocabulary to split some multi-byte characters"
    for ch in split:
        ids = ours.encode("a" + ch + "b")
        pieces, full = stream(ours, ids)
        assert full == "a" + ch + "b"
        assert "" in pieces[:-1], "the incomplete character should have produced an empty piece"
        assert any(ch in piece for piece in pieces)


def test_chat_template_errors_are_invalid_requests(
    tiny_checkpoints: dict[str, str], tmp_path: Path
) -> None:
    target = tmp_path / "tok"
    target.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (target / name).write_bytes((Path(tiny_checkpoints["qwen2"]) / name).read_bytes())
    config = json.loads((target / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok"
    )
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.from_checkpoint(target)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(InvalidRequestError, match="user first"):
        tokenizer.apply_chat_template([{"role": "assistant", "content": "x"}])
    del config["chat_template"]
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidRequestError, match="no chat_template"):
        Tokenizer.from_checkpoint(target).apply_chat_template([{"role": "user", "content": "x"}])


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=TEXT_STRATEGY)
def test_token_bytes_concatenate_to_the_texts_utf8(ours: Tokenizer, text: str) -> None:
    assert b"".join(ours.token_bytes(i) for i in ours.encode(text)) == text.encode()


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ids=st.lists(st.integers(min_value=0, max_value=1023), max_size=40))
def test_token_bytes_of_any_ids_decode_like_the_tokenizer(ours: Tokenizer, ids: list[int]) -> None:
    joined = b"".join(ours.token_bytes(i) for i in ids)
    assert joined.decode("utf-8", errors="replace") == ours.decode(ids, skip_special_tokens=False)


def test_token_bytes_of_special_and_partial_tokens(ours: Tokenizer) -> None:
    assert ours.token_bytes(ours.token_to_id("<|im_end|>")) == b"<|im_end|>"
    pieces = [ours.token_bytes(i) for i in ours.encode("🙂")]  # 4 UTF-8 bytes, several tokens
    assert b"".join(pieces) == "🙂".encode() and len(pieces) > 1
    assert ours.token_bytes(ours.vocab_size + 7) == b""  # a padded vocabulary row
