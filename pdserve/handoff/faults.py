"""Test-only fault injection at the wire layer. Production code passes None and pays nothing.

Tests use these to corrupt payloads, forge headers and slow a receiver down on purpose.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SenderFaults:
    """``corrupt_piece``: flip one byte of that piece after its digest was taken, right before
    the send (what a bit flip on the wire looks like). ``inflate_piece_bytes``: announce that
    many extra bytes in piece 0's header (a lying or buggy sender)."""

    corrupt_piece: int | None = None
    inflate_piece_bytes: int = 0
    source_address_shift: int = 0  # added to the cache address a SOURCE names (a lying peer)
    # Flip a bit of that read-slot piece/fence record after sealing (negative: begin record
    # ``-1 - n``).
    corrupt_slot_record: int | None = None
    begin_frames_delay_s: float = 0.0  # hold BEGIN and SOURCE back that long (late frames)


@dataclass(frozen=True)
class ReceiverFaults:
    """``recv_delay_s``: wait this long before posting the buffer of (or reading) each piece
    (a slow or overloaded receiver); the sender's rendezvous sends stay in flight meanwhile.
    ``corrupt_read_piece``: flip one byte of that piece as it is read from a same-host
    sender's cache, before hashing (what a bad read looks like)."""

    recv_delay_s: float = 0.0
    corrupt_read_piece: int | None = None
