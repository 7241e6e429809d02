"""A chat template's control tokens, and encoding a conversation so only the template makes them.

Message content is tokenized as text: ``<|im_end|>`` typed by a user stays seven-odd text tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

# Private-use characters: placeholders for control text in content while the template renders.
_MARKERS = tuple(chr(c) for c in range(0xE000, 0xE100))


@dataclass(frozen=True)
class ControlToken:
    text: str
    token_id: int
    lstrip: bool  # absorbs the whitespace before it, as the tokenizer's added token does
    rstrip: bool  # absorbs the whitespace after it


class ControlTokens:
    """The added tokens a conversation's content must never produce: those flagged special,
    and any other whose text the chat template itself writes (not every model flags its
    structural markers special). Everything else encodes exactly as the tokenizer does.

    How: content's control text is swapped for placeholders before the template renders, so
    every control text left in the rendering is the template's. The rendering is cut at those
    (where the tokenizer itself would cut it), and each piece in between, placeholders put
    back, is encoded by a copy of the tokenizer that reads control text as plain text.
    Control tokens are matched on the raw text, as chat models' are (``normalized: false``).
    """

    def __init__(self, backend: HFTokenizer, template_source: str) -> None:
        added = backend.get_added_tokens_decoder()
        self.tokens = {
            token.content: ControlToken(token.content, token_id, token.lstrip, token.rstrip)
            for token_id, token in sorted(added.items())
            if token.content and (token.special or token.content in template_source)}
        self._names = list(self.tokens)
        self._indices = {text: index for index, text in enumerate(self._names)}
        self._template_source = template_source
        # Longest first: at one position the longest control text wins, as in the tokenizer.
        self._pattern = re.compile("|".join(
            re.escape(text) for text in sorted(self.tokens, key=len, reverse=True)) or "(?!)")
        self._first_piece = _text_backend(backend, self.tokens, later_piece=False)
        self._later_piece = _text_backend(backend, self.tokens, later_piece=True)

    def pick_marker(self, texts: Iterable[str]) -> str:
        """A placeholder character found in none of ``texts`` nor in the template."""
        joined = "".join([self._template_source, *texts])
        for marker in _MARKERS:
            if marker not in joined:
                return marker
        raise ValueError("message content uses every private-use placeholder character")

    def neutralize(self, content: str, marker: str) -> str:
        """``content`` with each control text replaced by ``marker``, its index, ``marker``."""
        return self._pattern.sub(lambda m: f"{marker}{self._indices[m.group()]}{marker}", content)

    def encode(self, rendered: str, marker: str) -> list[int]:
        """Token ids of a rendering made from neutralized content: the template's control
        texts become their tokens, everything else (content included) is text."""
        ids: list[int] = []
        start = 0
        for match in self._pattern.finditer(rendered):
            token = self.tokens[match.group()]
            piece = rendered[start:match.start()]
            ids += self._encode_text(piece.rstrip() if token.lstrip else piece, start, marker)
            ids.append(token.token_id)
            start = match.end()
            if token.rstrip:
                start += len(rendered[start:]) - len(rendered[start:].lstrip())
        ids += self._encode_text(rendered[start:], start, marker)
        return ids

    def _encode_text(self, piece: str, offset: int, marker: str) -> list[int]:
        if not piece:
            return []
        text = re.sub(f"{marker}(\\d+){marker}", lambda m: self._names[int(m.group(1))], piece)
        backend = self._first_piece if offset == 0 else self._later_piece
        return list(backend.encode(text, add_special_tokens=False).ids)


def _text_backend(backend: HFTokenizer, tokens: dict[str, ControlToken],
                  later_piece: bool) -> HFTokenizer:
    """A copy of ``backend`` that encodes control text as plain text. With ``later_piece``,
    for text that does not start the rendering: a Metaspace pre-tokenizer that prepends its
    space only to the first piece of a text (``prepend_scheme: first``) then prepends none."""
    data: dict[str, Any] = json.loads(backend.to_str())
    for entry in data.get("added_tokens", []):
        if entry["content"] in tokens:
            entry["special"] = True  # encode_special_tokens then splits it as text
    if later_piece:
        for pre_tokenizer in _metaspaces(data.get("pre_tokenizer")):
            if pre_tokenizer.get("prepend_scheme") == "first":
                pre_tokenizer["prepend_scheme"] = "never"
    copy = HFTokenizer.from_str(json.dumps(data))
    copy.encode_special_tokens = True
    return copy


def _metaspaces(pre_tokenizer: Any) -> Sequence[dict[str, Any]]:
    if not isinstance(pre_tokenizer, dict):
        return []
    if pre_tokenizer.get("type") == "Metaspace":
        return [pre_tokenizer]
    return [m for inner in pre_tokenizer.get("pretokenizers", []) for m in _metaspaces(inner)]
