"""The token plane's wire: how a decode replica proves itself to an ingress replica, and how
each engine step's new tokens for that ingress travel as one MAC'd msgpack frame.

The ingress listens; a decode replica connects. The handshake and the numbered, MAC'd
frames are `planes/link.py`'s, under this plane's labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from pdserve import auth
from pdserve.engine.logprobs import TokenLogprobs
from pdserve.planes.link import (
    PlaneError,
    PlaneProtocol,
)

TOKEN_PLANE = PlaneProtocol(
    name="token plane", magic=b"PDTP", version=1,
    purpose=auth.Purpose(b"pdserve-tokens-proof-v1", b"pdserve-tokens-session-v1"),
    listener="ingress", connector="decode replica")


@dataclass(frozen=True)
class TokenSink:
    """Where a decode replica sends a request's tokens: an ingress replica's token plane.
    ``plane_id`` tells one start of an ingress from the next on the same address."""

    host: str
    port: int
    plane_id: str


class TokenEntry(NamedTuple):
    """One request's new output of one engine step; a frame is a list of them, each an
    array on the wire in this order. ``num_output_tokens`` and ``prev_token_id`` let the
    ingress check that an entry continues exactly the tokens its client has
    (router/token_plane.py `TokenSubscription`)."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_output_tokens: int  # after this entry
    num_cached_tokens: int
    logprobs: list[Any] | None  # `encode_logprobs`
    kv_reuse: list[Any] | None  # `KVReuse.to_wire`: a locally prefilled request's first entry
    prev_token_id: int  # the output token this entry's tokens continue (-1: none)


def encode_logprobs(logprobs: list[TokenLogprobs]) -> list[Any] | None:
    """[[token_id, logprob, [[id, logprob], ...]], ...], or None for none."""
    if not logprobs:
        return None
    return [[lp.token_id, lp.logprob, [list(t) for t in lp.top]] for lp in logprobs]


def decode_logprobs(raw: list[Any] | None) -> list[TokenLogprobs]:
    if not raw:
        return []
    return [TokenLogprobs(int(t), float(lp), [(int(i), float(v)) for i, v in top])
            for t, lp, top in raw]


_NUM_FIELDS = len(TokenEntry._fields)


def parse_entries(message: Any) -> list[TokenEntry]:
    """A frame's message as entries; `PlaneError` unless it is a list of them."""
    if not isinstance(message, list) or not all(
            isinstance(e, list) and len(e) == _NUM_FIELDS and isinstance(e[0], str)
            for e in message):
        raise PlaneError("token plane frame is not a list of token entries")
    return [TokenEntry._make(e) for e in message]
