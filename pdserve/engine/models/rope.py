"""Rotary position embeddings (rotate-half convention of HF Llama/Qwen2), with llama3 scaling.

Frequencies are computed exactly as transformers does, so logits match to float32 rounding.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    """float32 [head_dim // 2] inverse frequencies, llama3-rescaled when `scaling` asks for it."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    return _llama3_rescale(inv_freq, scaling)


def _llama3_rescale(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 long-context scaling: divide low frequencies by `factor`, keep high ones,
    and interpolate linearly (in 1/wavelength) between the two bands."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin tables for given positions; no parameters (safe to build on the meta device)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None) -> None:
        self._inv_freq_cpu = inverse_frequencies(head_dim, theta, scaling)
        self._inv_freq_by_device: dict[torch.device, torch.Tensor] = {}

    def _inv_freq(self, device: torch.device) -> torch.Tensor:
        cached = self._inv_freq_by_device.get(device)
        if cached is None:
            cached = self._inv_freq_cpu.to(device)
            self._inv_freq_by_device[device] = cached
        return cached

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, head_dim] cos and sin of int64 `positions` [T]: float32 math, cast to `dtype`.

        The sin table's first half is negated, the form `apply_rotary` takes.
        """
        freqs = positions.float()[:, None] * self._inv_freq(positions.device)[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        sin = angles.sin()
        sin[:, : sin.shape[1] // 2].neg_()
        return angles.cos().to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [T, heads, head_dim] by the tables of `RotaryEmbedding.cos_sin`.

    HF's rotate-half, ``x * cos + cat(-x2, x1) * sin``, with the minus moved into the table:
    ``roll(x) * signed_sin`` has the same products, exactly, in one op fewer.
    """
    rolled = x.roll(x.shape[-1] // 2, dims=-1)
    return (x * cos).add_(rolled.mul_(signed_sin))
