"""Grammar masks on CPU logits: pdserve's C loop and the numpy fallback set exactly the tokens
xgrammar's own kernel sets to -inf, in the masked rows only.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
import xgrammar as xgr

from pdserve.engine import mask_apply
from pdserve.engine.grammar import GrammarCompiler
from pdserve.engine.grammar_masks import GrammarMasks, StepMask
from tests.support.native_builds import fresh_build

Apply = Callable[[torch.Tensor, torch.Tensor, Sequence[int]], None]


def _c_loop() -> Apply:
    kernel = mask_apply.mask_kernel()
    assert kernel is not None, "the C loop did not build (see the log)"
    return kernel


WAYS: dict[str, Callable[[], Apply]] = {
    "c": _c_loop,
    "numpy": lambda: mask_apply.apply_with_numpy,
    "step_mask": lambda: lambda logits, bitmask, rows: StepMask(bitmask, list(rows)).apply(
        logits),
}


def _case(rows: int, vocab: int, sparse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits with a -inf among them and a bitmask: random words, or a grammar's kind (most
    words all-zero, some all-one, a few mixed)."""
    generator = torch.Generator().manual_seed(rows * vocab + sparse)
    bitmask = xgr.allocate_token_bitmask(rows, vocab)
    bitmask.random_(-2**31, 2**31 - 1, generator=generator)
    if sparse:
        kind = torch.randint(0, 4, bitmask.shape, generator=generator)
        bitmask[kind == 0] = 0
        bitmask[kind == 1] = -1
    logits = torch.randn(rows, vocab, generator=generator) * 50
    logits[0, 3] = float("-inf")
    return logits, bitmask


@pytest.mark.parametrize("way", sorted(WAYS))
@pytest.mark.parametrize(("rows", "vocab", "masked", "sparse"), [
    (8, 1024, None, False), (8, 1000, [1, 5, 7], True), (3, 32_005, [0, 2], False),
    (1, 33, None, True), (32, 8_000, list(range(0, 32, 2)), True)])
def test_the_same_tokens_as_the_grammar_library(way: str, rows: int, vocab: int,
                                                masked: list[int] | None, sparse: bool) -> None:
    """Only the masked rows change, -inf stays -inf, no NaN and no floating-point warning."""
    logits, bitmask = _case(rows, vocab, sparse)
    expected, got = logits.clone(), logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask, indices=masked)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        WAYS[way]()(got, bitmask, masked if masked is not None else list(range(rows)))
    assert torch.equal(got, expected)
    assert bool(torch.isinf(got).any()) and not bool(torch.isnan(got).any())


def test_a_bitmask_with_spare_rows_masks_the_logits_rows_only() -> None:
    """The runner's bitmask is allocated for the largest batch seen; a smaller batch's logits
    take its first rows."""
    logits, bitmask = _case(4, 100, False)
    spare = torch.cat([bitmask, torch.zeros_like(bitmask)])
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask)
    for apply in (_c_loop(), mask_apply.apply_with_numpy):
        got = logits.clone()
        apply(got, spare, [0, 1, 2, 3])
        assert torch.equal(got, expected)


def test_without_a_compiler_numpy_applies_and_the_log_says_why(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with fresh_build(monkeypatch, tmp_path, mask_apply.mask_kernel, compiler=False):
        with caplog.at_level(logging.WARNING, logger=mask_apply.__name__):
            assert mask_apply.mask_kernel() is None
        assert "numpy applies them instead" in caplog.text
        logits, bitmask = _case(4, 1000, True)
        expected, got = logits.clone(), logits.clone()
        xgr.apply_token_bitmask_inplace(expected, bitmask, indices=[1, 3])
        mask_apply.apply_on_cpu(got, bitmask, [1, 3])
        assert torch.equal(got, expected)


def test_cpu_masks_build_the_loop_at_start_up(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    """A fresh cache directory: the first constrained step would otherwise pay the compile."""
    compiler = GrammarCompiler(64, lambda: [b"x"] * 64, [0])
    with fresh_build(monkeypatch, tmp_path, mask_apply.mask_kernel) as built:
        masks = GrammarMasks(compiler, torch.device("cpu"))
        masks.close()
        compiler.close()
        assert mask_apply.mask_kernel.cache_info().currsize == 1
        assert list(built.glob("mask_apply-*.so"))
