"""The shape of the paged KV cache, as prefill and decode must agree on it.

The handoff carries a `KVLayout` with every transfer; a receiver refuses any that differs.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, fields
from typing import Any

import torch

# Dtype names on the wire; torch dtypes never cross a process boundary as objects.
DTYPE_BY_NAME: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
NAME_BY_DTYPE: dict[torch.dtype, str] = {v: k for k, v in DTYPE_BY_NAME.items()}


class LayoutMismatchError(ValueError):
    """Two KV layouts that must agree do not; the message names the differing fields."""


@dataclass(frozen=True)
class KVLayout:
    """Everything needed to interpret a KV block's bytes.

    The cache of one worker is one tensor of shape
    ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0 of the
    second axis is K, 1 is V). One block of one layer of K (or V) is therefore a contiguous
    run of ``block_size * num_kv_heads * head_dim`` elements: the unit the handoff moves.
    ``layer_start``/``layer_end`` say which of the model's layers this cache holds
    (pipeline stages hold a range; a whole model holds ``0..num_layers``).
    """

    model_fingerprint: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_rank: int = 0
    tp_size: int = 1
    layer_start: int = 0
    layer_end: int = -1  # -1: up to num_layers

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BY_NAME:
            raise ValueError(
                f"KV dtype {self.dtype!r} unsupported; use one of {sorted(DTYPE_BY_NAME)}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim", "tp_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"KVLayout.tp_rank {self.tp_rank} outside [0, {self.tp_size})")
        if self.layer_end == -1:
            object.__setattr__(self, "layer_end", self.num_layers)
        if not 0 <= self.layer_start < self.layer_end <= self.num_layers:
            raise ValueError(
                f"KVLayout layer range [{self.layer_start}, {self.layer_end}) is not inside "
                f"[0, {self.num_layers})"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPE_BY_NAME[self.dtype]

    @property
    def element_size(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def num_local_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def block_elements(self) -> int:
        """Elements in one block of one layer of K (or of V)."""
        return self.block_size * self.num_kv_heads * self.head_dim

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer, K and V together."""
        return 2 * self.block_elements * self.element_size

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_local_layers, 2, num_blocks, self.block_size, self.num_kv_heads,
                self.head_dim)

    @property
    def fingerprint(self) -> str:
        """What stored KV is keyed by beside its block hash: every field (model, dtype, block
        size, shape, TP rank and size, layer range), so a layout that differs in any of them
        never finds another's bytes."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:32]

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # all plain values

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown KVLayout fields {sorted(unknown)}")
        return cls(**data)

    def check_matches(self, other: KVLayout) -> None:
        """Raise `LayoutMismatchError` naming every field where `other` differs from self."""
        diffs = [
            f"{f.name}: expected {getattr(self, f.name)!r}, got {getattr(other, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]
        if diffs:
            raise LayoutMismatchError("KV layout mismatch: " + "; ".join(diffs))
