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


def kv_head_range(num_kv_heads: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """The KV heads ``[start, end)`` TP rank ``tp_rank`` of ``tp_size`` holds: an equal share
    when the heads divide among the ranks, else (more ranks than heads, a multiple of them)
    one head, each head on ``tp_size / num_kv_heads`` consecutive ranks."""
    start = tp_rank * num_kv_heads // tp_size
    return start, start + max(1, num_kv_heads // tp_size)


@dataclass(frozen=True)
class KVLayout:
    """Everything needed to interpret a KV block's bytes.

    The cache of one worker (one TP rank) is one tensor of shape
    ``[num_layers, 2, num_blocks, *block_dims]`` (index 0 of the second axis is K, 1 is V).
    One block of one layer of K (or V) is therefore a contiguous run of
    ``block_size * local_kv_heads * head_dim`` elements: the unit the handoff moves.
    ``num_kv_heads`` counts the model's KV heads; TP rank ``tp_rank`` of ``tp_size`` holds
    ``kv_head_range`` of them. ``layer_start``/``layer_end`` say which of the model's layers
    this cache holds (pipeline stages hold a range; a whole model holds ``0..num_layers``).
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
        if self.num_kv_heads % self.tp_size and self.tp_size % self.num_kv_heads:
            raise ValueError(f"KVLayout: {self.num_kv_heads} KV heads do not split across "
                             f"tp_size {self.tp_size}")
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
    def kv_heads(self) -> tuple[int, int]:
        """The model's KV heads ``[start, end)`` this cache holds."""
        return kv_head_range(self.num_kv_heads, self.tp_rank, self.tp_size)

    @property
    def local_kv_heads(self) -> int:
        start, end = self.kv_heads
        return end - start

    @property
    def block_dims(self) -> tuple[int, int, int]:
        """One block of one layer of K (or V) in memory order: tokens, heads, head dim."""
        return (self.block_size, self.local_kv_heads, self.head_dim)

    @property
    def head_axis(self) -> int:
        """Which of `block_dims` counts heads."""
        return 1

    @property
    def block_elements(self) -> int:
        """Elements in one block of one layer of K (or of V)."""
        return self.block_size * self.local_kv_heads * self.head_dim

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer, K and V together."""
        return 2 * self.block_elements * self.element_size

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_local_layers, 2, num_blocks, *self.block_dims)

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
        check_known_fields(cls, data)
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

    def check_pairs_with(self, other: KVLayout, heads: tuple[int, int]) -> None:
        """Raise `LayoutMismatchError` unless ``other`` (a rank of another TP group) may send
        or receive KV heads ``heads`` of this one: every field equal but the TP rank and size,
        and both caches hold those heads. The message names what differs."""
        diffs = [
            f"{f.name}: expected {getattr(self, f.name)!r}, got {getattr(other, f.name)!r}"
            for f in fields(self)
            if f.name not in _TP_FIELDS and getattr(self, f.name) != getattr(other, f.name)
        ]
        for layout, side in ((self, "this side"), (other, "the other side")):
            start, end = layout.kv_heads
            if not start <= heads[0] < heads[1] <= end:
                diffs.append(
                    f"KV heads [{heads[0]}, {heads[1]}) are not in {side}'s "
                    f"[{start}, {end}) (TP rank {layout.tp_rank} of {layout.tp_size})")
        if diffs:
            raise LayoutMismatchError("KV layouts cannot be paired: " + "; ".join(diffs))


_TP_FIELDS = ("tp_rank", "tp_size")


@dataclass(frozen=True)
class KVSlice:
    """KV heads ``heads`` (the model's numbering) of every block of a cache with ``layout``:
    what one transfer moves. Per block of one layer of K (or V) that is ``block_elements``
    elements, the layout's block dims with the heads narrowed to ``heads``, in memory order.
    The whole of the layout's heads is one contiguous run per block."""

    layout: KVLayout
    heads: tuple[int, int]

    def __post_init__(self) -> None:
        start, end = self.layout.kv_heads
        if not start <= self.heads[0] < self.heads[1] <= end:
            raise ValueError(f"KVSlice heads {self.heads} outside the layout's [{start}, {end})")

    @classmethod
    def whole(cls, layout: KVLayout) -> KVSlice:
        return cls(layout, layout.kv_heads)

    @property
    def is_whole(self) -> bool:
        return self.heads == self.layout.kv_heads

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def head_offset(self) -> int:
        """The slice's first head among the cache's own (local) heads."""
        return self.heads[0] - self.layout.kv_heads[0]

    @property
    def num_local_layers(self) -> int:
        return self.layout.num_local_layers

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.layout.torch_dtype

    @property
    def element_size(self) -> int:
        return self.layout.element_size

    @property
    def block_dims(self) -> tuple[int, ...]:
        """One block's elements of these heads, in the layout's memory order."""
        dims = list(self.layout.block_dims)
        dims[self.layout.head_axis] = self.num_heads
        return tuple(dims)

    @property
    def block_elements(self) -> int:
        return self.layout.block_elements // self.layout.local_kv_heads * self.num_heads

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer, K and V together."""
        return 2 * self.block_elements * self.element_size


def check_known_fields(record: type, data: dict[str, Any]) -> None:
    """A record's dict from another process names only the record's fields (a peer running
    other code says so at once, not as a wrong value later)."""
    unknown = set(data) - {f.name for f in fields(record)}
    if unknown:
        raise ValueError(f"unknown {record.__name__} fields {sorted(unknown)}")
