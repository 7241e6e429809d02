"""The sampler's counter-based uniforms: a pure function of (seed, output index), uniform on
[0, 1), independent between neighbouring keys, and exact as float32 on any device."""

from __future__ import annotations

import numpy as np
import torch

from pdserve.engine.random_draws import (
    UNIFORM_BITS,
    DrawKey,
    draw_bits,
    draw_uniforms,
    uniforms_from_bits,
)


def test_a_key_always_gives_the_same_bits_whatever_its_company() -> None:
    key = DrawKey(1234, 5)
    alone = draw_bits([key])
    assert draw_bits([DrawKey(1, 0), key, None, DrawKey(1234, 6)])[1] == alone[0]
    assert draw_bits([key] * 3) == alone * 3
    assert draw_bits([]) == []


def test_seeds_are_taken_modulo_two_to_the_64() -> None:
    assert draw_bits([DrawKey(-1, 3)]) == draw_bits([DrawKey(2**64 - 1, 3)])
    assert draw_bits([DrawKey(-(2**63), 0)]) == draw_bits([DrawKey(2**63, 0)])


def test_neighbouring_seeds_and_indices_give_unrelated_draws() -> None:
    """Seeds a stream increment apart, or shifted by one index, must not replay each other."""
    seeds = [DrawKey(s, i) for s in range(64) for i in range(64)]
    bits = draw_bits(seeds)
    assert len(set(bits)) > 0.99 * len(bits)  # 4,096 draws of 24 bits: few collisions
    shifted = draw_bits([DrawKey(0x9E3779B97F4A7C15, i) for i in range(64)])
    assert len(set(shifted) & set(bits[:64])) <= 1
    # Consecutive draws of one stream are uncorrelated.
    stream = np.array(draw_bits([DrawKey(7, i) for i in range(20_000)]), dtype=np.float64)
    assert abs(np.corrcoef(stream[:-1], stream[1:])[0, 1]) < 0.03


def test_uniforms_are_exact_multiples_of_the_resolution_and_evenly_spread() -> None:
    n = 50_000
    u = draw_uniforms([DrawKey(99, i) for i in range(n)], "cpu")
    assert u.dtype == torch.float32 and u.min() >= 0 and u.max() < 1
    scaled = u.double() * 2**UNIFORM_BITS
    assert torch.equal(scaled, scaled.round())  # float32 held every bit
    # Kolmogorov-Smirnov against U(0, 1): the statistic stays far below its 0.1% level.
    sorted_u = u.double().sort().values
    grid = torch.arange(1, n + 1, dtype=torch.float64) / n
    ks = torch.maximum((grid - sorted_u).abs(), (sorted_u - (grid - 1 / n)).abs()).max()
    assert ks < 1.95 / n**0.5
    counts = torch.histc(u, bins=16, min=0, max=1)
    assert ((counts - n / 16).abs() < 5 * (n / 16) ** 0.5).all()


def test_bits_convert_to_uniforms_exactly() -> None:
    bits = torch.tensor([0, 1, 2**UNIFORM_BITS - 1], dtype=torch.int64)
    assert uniforms_from_bits(bits).tolist() == [0.0, 2.0**-UNIFORM_BITS,
                                                 1 - 2.0**-UNIFORM_BITS]
