"""Counter-based random numbers for sampling: a row's uniform is a pure function of its key (the
request's seed, the index of the output token it draws), mixed from 64-bit integers on the host.

So a draw depends on nothing else: not the batch, the device, the role that samples it, or
earlier draws; and no per-row generator state exists to seed, copy or launch kernels for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# Bits of each uniform: float32 holds them exactly, so the host and every device see one value.
UNIFORM_BITS = 24
_GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)  # SplitMix64's stream increment


@dataclass(frozen=True)
class DrawKey:
    """Which random number a sampled row uses."""

    seed: int  # the request's seed, any int (taken modulo 2**64, as torch seeds are)
    index: int  # the output token being drawn (0: the first, which prefill draws)


def draw_bits(keys: Sequence[DrawKey | None]) -> list[int]:
    """Each key's uniform as an integer in ``[0, 2**UNIFORM_BITS)`` (None: a row that draws
    nothing, greedy, whose value is never read). A few numpy operations per step, whatever
    the batch."""
    if not keys:
        return []
    seeds = np.array([0 if k is None else k.seed % 2**64 for k in keys], dtype=np.uint64)
    indices = np.array([0 if k is None else k.index for k in keys], dtype=np.uint64)
    # SplitMix64 at position index+1 of a stream whose start is the mixed seed: seeds a stream
    # apart never share draws, and every output word passes BigCrush.
    with np.errstate(over="ignore"):
        words = _mix(_mix(seeds) + (indices + np.uint64(1)) * _GOLDEN_GAMMA)
    bits: list[int] = (words >> np.uint64(64 - UNIFORM_BITS)).tolist()
    return bits


def uniforms_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """`draw_bits` (an int64 tensor) as float32 uniforms in ``[0, 1)`` on the same device,
    exactly: every value is a multiple of ``2**-UNIFORM_BITS``."""
    return bits.to(torch.float32) * 2.0**-UNIFORM_BITS


def draw_uniforms(keys: Sequence[DrawKey | None], device: torch.device | str) -> torch.Tensor:
    """`draw_bits` then `uniforms_from_bits`, for callers without a batched upload."""
    bits = torch.tensor(draw_bits(keys), dtype=torch.int64)
    return uniforms_from_bits(bits).to(device)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function (Steele, Lea and Flood, 2014): a bijection on 64-bit words."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))
