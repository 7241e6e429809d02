"""A checkpoint's tokenizer: encode/decode, the chat template, streaming detokenization.

Matches transformers' AutoTokenizer on the same files (encode, decode, apply_chat_template).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

from pdserve.engine.control_tokens import ControlTokens
from pdserve.engine.errors import CheckpointError, InvalidRequestError

_SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_REPLACEMENT_CHAR = "\ufffd"
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte, inverted: printable Latin-1 bytes
    stand for themselves, the other 68 take the code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = [b for b in range(256) if b not in printable]
    alphabet = {chr(b): b for b in printable}
    alphabet.update({chr(256 + n): b for n, b in enumerate(others)})
    return alphabet


_BYTE_LEVEL = _byte_level_alphabet()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile in a sandbox with the environment transformers gives chat templates."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class Tokenizer:
    """tokenizer.json plus what tokenizer_config.json adds (chat template, special tokens)."""

    def __init__(
        self,
        backend: HFTokenizer,
        chat_template: str | None,
        special_tokens: dict[str, str],
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self._backend = backend
        self._chat_template_source = chat_template
        self._chat_template = compile_chat_template(chat_template) if chat_template else None
        self._controls = ControlTokens(backend, chat_template) if chat_template else None
        self.special_tokens = dict(special_tokens)
        self.eos_token_ids = eos_token_ids
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self._byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        # Added tokens are stored as their text, never in the byte-level alphabet.
        self._token_bytes: dict[int, bytes] = {
            token_id: added.content.encode()
            for token_id, added in backend.get_added_tokens_decoder().items()}
        # Control tokens (<|im_end|>, ...): a grammar never lets one stand for its text.
        self.special_token_ids = frozenset(
            token_id for token_id, added in backend.get_added_tokens_decoder().items()
            if added.special)
        self._max_token_bytes: int | None = None

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> Tokenizer:
        root = Path(path)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise CheckpointError(
                f"{tokenizer_file} not found: pdserve needs a fast-tokenizer tokenizer.json"
            )
        try:
            backend = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust binding raises plain Exception subclasses
            raise CheckpointError(f"cannot load {tokenizer_file}: {exc}") from exc
        config = _read_optional_json(root / "tokenizer_config.json")
        special_tokens = {
            name: _token_content(config[name])
            for name in _SPECIAL_TOKEN_NAMES
            if config.get(name) is not None
        }
        return cls(
            backend,
            _chat_template(root, config),
            special_tokens,
            _eos_ids(root, backend, special_tokens),
        )

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # encode_batch releases the GIL while it tokenizes (encode holds it throughout), so
        # a long prompt tokenized on a worker thread leaves the caller's event loop running.
        [encoding] = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(encoding.ids)

    def min_num_tokens(self, text: str) -> int:
        """A lower bound on the tokens ``text`` becomes, without tokenizing it: no token
        stands for more bytes than the vocabulary's longest. 0 (no bound) when a normalizer
        may shrink the text first."""
        if self._backend.normalizer is not None:
            return 0
        return -(-len(text.encode()) // self.max_token_bytes)

    @property
    def max_token_bytes(self) -> int:
        """The most bytes one token of the vocabulary stands for."""
        if self._max_token_bytes is None:
            self._max_token_bytes = max(
                (len(self.token_bytes(i)) for i in range(self.vocab_size)), default=1) or 1
        return self._max_token_bytes

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, even a part of a UTF-8 character (what OpenAI's
        logprobs list as ``bytes``): added tokens as the UTF-8 of their text, byte-level BPE
        pieces mapped back through their byte alphabet, ``<0xNN>`` byte-fallback pieces as that
        byte, any other piece (SentencePiece words with ``▁`` for a space) as UTF-8."""
        cached = self._token_bytes.get(token_id)
        if cached is not None:
            return cached
        piece = self._backend.id_to_token(token_id)
        if piece is None:  # a model's padded vocabulary rows (a top alternative, say)
            return b""
        if self._byte_level and all(c in _BYTE_LEVEL for c in piece):
            data = bytes(_BYTE_LEVEL[c] for c in piece)
        elif fallback := _BYTE_FALLBACK.fullmatch(piece):
            data = bytes([int(fallback.group(1), 16)])
        else:
            data = piece.replace("\u2581", " ").encode()
        self._token_bytes[token_id] = data
        return data

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Render `messages` (and `tools`, OpenAI-shaped) as
        AutoTokenizer.apply_chat_template(tokenize=False) does."""
        if self._chat_template is None:
            raise _no_chat_template()
        # transformers drops None-valued keys; it passes only the special tokens that are set.
        cleaned = [{k: v for k, v in message.items() if v is not None} for message in messages]
        try:
            return self._chat_template.render(
                messages=cleaned, tools=tools, add_generation_prompt=add_generation_prompt,
                **self.special_tokens)
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidRequestError(f"the chat template rejected the messages: {exc}") from exc

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The conversation's prompt ids. Unlike encoding `apply_chat_template`'s text, the
        special-token text (``<|im_end|>``, ``<|im_start|>system``) of the content, of past
        tool calls and of the tools' definitions is tokenized as text: only the template
        makes control tokens, so no client text can forge a role. Text without such text gets
        exactly the ids of that plain encoding."""
        controls = self._controls
        if controls is None:
            raise _no_chat_template()
        marker = controls.pick_marker(_strings([messages, tools]))

        def neutral(value: Any) -> Any:
            if isinstance(value, str):
                return controls.neutralize(value, marker)
            if isinstance(value, dict):
                return {neutral(k): neutral(v) for k, v in value.items()}
            if isinstance(value, list):
                return [neutral(v) for v in value]
            return value

        return controls.encode(self.apply_chat_template(
            neutral(messages), add_generation_prompt, neutral(tools)), marker)


def _strings(value: Any) -> Iterator[str]:
    """Every string in nested lists and dicts, keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def _no_chat_template() -> InvalidRequestError:
    return InvalidRequestError("this model's tokenizer_config.json has no chat_template; "
                               "send a plain completion instead")


def _read_optional_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot parse {file}: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _token_content(value: str | dict[str, Any]) -> str:
    return str(value["content"]) if isinstance(value, dict) else str(value)


def _chat_template(root: Path, config: dict[str, Any]) -> str | None:
    # transformers 5 saves templates as chat_template.jinja; older checkpoints embed them.
    standalone = root / "chat_template.jinja"
    if standalone.is_file():
        return standalone.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {
            entry.get("name"): entry.get("template")
            for entry in template
            if isinstance(entry, dict)
        }
        template = named.get("default")
    return template if isinstance(template, str) else None


def _eos_ids(root: Path, backend: HFTokenizer, special_tokens: dict[str, str]) -> tuple[int, ...]:
    """generation_config.json's eos ids, else config.json's, else the tokenizer's eos token."""
    for name in ("generation_config.json", "config.json"):
        value = _read_optional_json(root / name).get("eos_token_id")
        if value is not None:
            return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)
    eos = special_tokens.get("eos_token")
    eos_id = backend.token_to_id(eos) if eos is not None else None
    return (eos_id,) if eos_id is not None else ()


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces, never splitting a UTF-8 character.

    Decodes a short window of recent tokens (starting at a character boundary, so tokenizers
    that drop a leading space still see context) and emits what the window added. Trailing
    U+FFFD, which is how an incomplete multi-byte character decodes, is held back until later
    bytes complete it; `flush` releases anything still held at the end of the stream.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._window_start = 0  # index into _ids where the decoded window begins
        self._emitted = 0  # characters of the window's text already emitted
        self._last_boundary = 0  # latest index where all bytes so far formed whole characters
        self._text = ""

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return self._text

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def _decode_window(self) -> str:
        return self._tokenizer.decode(self._ids[self._window_start :], self._skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (possibly empty)."""
        self._ids.append(token_id)
        window_text = self._decode_window()
        stable = len(window_text.rstrip(_REPLACEMENT_CHAR))
        piece = window_text[self._emitted : stable] if stable > self._emitted else ""
        self._emitted = max(self._emitted, stable)
        if stable == len(window_text):
            # Everything decoded is whole: slide the window to the previous boundary so its
            # length (and decode cost) stays bounded, keeping one step of context.
            if self._last_boundary > self._window_start:
                self._window_start = self._last_boundary
                self._emitted = len(self._decode_window())
            self._last_boundary = len(self._ids)
        self._text += piece
        return piece

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character decodes as U+FFFD)."""
        window_text = self._decode_window()
        piece = window_text[self._emitted :]
        self._emitted = len(window_text)
        self._text += piece
        return piece
