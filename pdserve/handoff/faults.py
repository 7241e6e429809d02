"""Test-only fault injection at the wire layer. Production code passes None and pays nothing.

Tests use these to corrupt payloads, forge headers and slow a receiver down on purpose.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SenderFaults:
    """``corrupt_piece``: flip one byte of that piece after its digest was taken, right before
    the send (what a bit flip on the wire looks like). ``inflate_piece_bytes``: announce that
    many extra bytes in piece 0's header (a lying or buggy sender). ``pad_piece_bytes``: send
    that many bytes more than piece 0's header announced (an oversized payload)."""

    corrupt_piece: int | None = None
    inflate_piece_bytes: int = 0
    pad_piece_bytes: int = 0


@dataclass(frozen=True)
class ReceiverFaults:
    """``recv_delay_s``: wait this long before posting the buffer of each piece (a slow or
    overloaded receiver); the sender's rendezvous sends stay in flight meanwhile."""

    recv_delay_s: float = 0.0
