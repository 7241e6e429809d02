"""Peer authentication from the cluster's shared token: challenge-response, then per-message MACs.

The token never crosses the wire; both sides derive a per-session key from it and two nonces.
A `Purpose` keeps the proofs and keys of the KV handoff and the token plane apart.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass

NONCE_BYTES = 16
MAC_BYTES = 16


@dataclass(frozen=True)
class Purpose:
    """The labels one protocol's proofs and session keys are made with."""

    proof_label: bytes
    session_label: bytes


HANDOFF = Purpose(b"pdserve-handoff-proof-v1", b"pdserve-handoff-session-v1")


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def _transcript(session_id: int, sender_nonce: bytes, receiver_nonce: bytes) -> bytes:
    return session_id.to_bytes(8, "little") + sender_nonce + receiver_nonce


def proof(token: str, session_id: int, sender_nonce: bytes, receiver_nonce: bytes,
          purpose: Purpose = HANDOFF) -> bytes:
    """What the sender answers to a challenge; binds the proof to both nonces and the session."""
    message = purpose.proof_label + _transcript(session_id, sender_nonce, receiver_nonce)
    return hmac.new(token.encode(), message, hashlib.sha256).digest()


def check_proof(
    token: str, session_id: int, sender_nonce: bytes, receiver_nonce: bytes, candidate: bytes,
    purpose: Purpose = HANDOFF,
) -> bool:
    expected = proof(token, session_id, sender_nonce, receiver_nonce, purpose)
    return hmac.compare_digest(expected, candidate)


def session_key(token: str, session_id: int, sender_nonce: bytes, receiver_nonce: bytes,
                purpose: Purpose = HANDOFF) -> bytes:
    """Key for the MACs of every later message of this session, in both directions."""
    message = purpose.session_label + _transcript(session_id, sender_nonce, receiver_nonce)
    return hmac.new(token.encode(), message, hashlib.sha256).digest()


def mac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()[:MAC_BYTES]


def check_mac(key: bytes, data: bytes, candidate: bytes) -> bool:
    return hmac.compare_digest(mac(key, data), candidate)
