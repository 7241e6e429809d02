"""Which part of the model one rank holds: its attention heads, KV heads, MLP columns and
vocabulary rows, and the check that a model splits across a TP degree at all.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.kv.layout import kv_head_range
from pdserve.engine.model_config import ModelConfig


class TPSplitError(ValueError):
    """The model does not split evenly across the requested tensor-parallel degree."""


def check_tp_fits(config: ModelConfig, tp_size: int, what: str = "tensor_parallel_size") -> None:
    """Refuse a TP degree the model cannot be split by, naming each count that does not
    divide (KV heads may also be fewer than the ranks, a multiple of them: each is then
    replicated on tp_size / num_kv_heads ranks)."""
    if tp_size < 1:
        raise TPSplitError(f"{what} must be at least 1, got {tp_size}")
    problems = []
    if config.num_heads % tp_size:
        problems.append(f"num_attention_heads {config.num_heads} is not a multiple of it")
    kv = config.num_kv_heads
    if kv % tp_size and tp_size % kv:
        problems.append(f"num_key_value_heads {kv} neither is a multiple of it nor divides it")
    if config.intermediate_size % tp_size:
        problems.append(f"intermediate_size {config.intermediate_size} is not a multiple of it")
    if problems:
        raise TPSplitError(f"{what} {tp_size} does not split this model: "
                           + "; ".join(problems))


@dataclass(frozen=True)
class TPShard:
    """Rank ``rank`` of ``size``: its contiguous share of each split dimension."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"TP rank {self.rank} outside [0, {self.size})")

    def even(self, total: int) -> tuple[int, int]:
        """(start, count) of an evenly divided dimension of ``total``."""
        count = total // self.size
        return self.rank * count, count

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(start, count) of the KV heads this rank holds."""
        start, end = kv_head_range(num_kv_heads, self.rank, self.size)
        return start, end - start

    def vocab_rows(self, vocab_size: int) -> tuple[int, int, int]:
        """(start, count, rows per rank): every rank holds ``ceil(vocab / size)`` rows, the
        last ones padding past the vocabulary, so gathered logits line up."""
        per_rank = -(-vocab_size // self.size)
        start = min(vocab_size, self.rank * per_rank)
        return start, min(vocab_size, start + per_rank) - start, per_rank
