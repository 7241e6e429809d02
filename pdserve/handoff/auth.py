"""Peer authentication from the cluster's shared token: challenge-response, then per-message MACs.

The token never crosses the wire; both sides derive a per-session key from it and two nonces.
"""

from __future__ import annotations

import hashlib
import hmac
import os

NONCE_BYTES = 16
MAC_BYTES = 16
_PROOF_LABEL = b"pdserve-handoff-proof-v1"
_SESSION_LABEL = b"pdserve-handoff-session-v1"


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def _transcript(session_id: int, sender_nonce: bytes, receiver_nonce: bytes) -> bytes:
    return session_id.to_bytes(8, "little") + sender_nonce + receiver_nonce


def proof(token: str, session_id: int, sender_nonce: bytes, receiver_nonce: bytes) -> bytes:
    """What the sender answers to a challenge; binds the proof to both nonces and the session."""
    message = _PROOF_LABEL + _transcript(session_id, sender_nonce, receiver_nonce)
    return hmac.new(token.encode(), message, hashlib.sha256).digest()


def check_proof(
    token: str, session_id: int, sender_nonce: bytes, receiver_nonce: bytes, candidate: bytes
) -> bool:
    expected = proof(token, session_id, sender_nonce, receiver_nonce)
    return hmac.compare_digest(expected, candidate)


def session_key(token: str, session_id: int, sender_nonce: bytes, receiver_nonce: bytes) -> bytes:
    """Key for the MACs of every later message of this session, in both directions."""
    message = _SESSION_LABEL + _transcript(session_id, sender_nonce, receiver_nonce)
    return hmac.new(token.encode(), message, hashlib.sha256).digest()


def mac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()[:MAC_BYTES]


def check_mac(key: bytes, data: bytes, candidate: bytes) -> bool:
    return hmac.compare_digest(mac(key, data), candidate)
