"""Content hash of one full KV block, chained onto its parent block's hash.

Equal hashes mean "same tokens after the same prefix under the same model" (the salt).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# SHA-256 rather than a fast non-cryptographic hash: block i's KV depends on every token
# before it, but a cache hit can only re-check block i's own tokens, so the chain is
# trusted through the hash. Tenants must not be able to forge a collision that makes them
# read KV computed for another prefix. Cost is ~1 µs per block.
BLOCK_HASH_BYTES = 32
_ROOT_MARKER = b"\x00"
_CHILD_MARKER = b"\x01"


def hash_block(parent: bytes | None, token_ids: Sequence[int], salt: str) -> bytes:
    """Hash of a full block: its parent's hash (None for the first block), its tokens, the salt.

    The encoding is fixed (little-endian int64 tokens, length-prefixed salt), so hashes
    agree across processes and machines, e.g. for prefix-affinity routing.
    """
    h = hashlib.sha256()
    if parent is None:
        h.update(_ROOT_MARKER)
    else:
        h.update(_CHILD_MARKER)
        h.update(parent)
    salt_bytes = salt.encode("utf-8")
    h.update(struct.pack("<I", len(salt_bytes)))
    h.update(salt_bytes)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    return h.digest()


def hash_full_blocks(
    token_ids: Sequence[int], block_size: int, salt: str, known: Sequence[bytes] = ()
) -> list[bytes]:
    """Chained hashes of every full block of ``token_ids``, reusing the ``known`` leading ones."""
    hashes = list(known)
    parent = hashes[-1] if hashes else None
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], salt)
        hashes.append(parent)
    return hashes
