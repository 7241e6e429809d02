"""pdserve's C decode-attention kernel (CPU): the PyTorch ops' answer on ragged batches of
decode rows and prompt chunks, in float32 and bfloat16, split among threads or not.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from pdserve.engine.attention import cpu_native
from pdserve.engine.attention.selection import select_attention_backend
from pdserve.engine.attention.torch_backend import TorchAttentionBackend
from tests.engine.attention_batches import ragged_batch, torch_reference
from tests.support.native_builds import fresh_build

# Decode rows with contexts across block boundaries, between prompt chunks.
DECODE_HEAVY = [(1, 37), (1, 1), (23, 23), (1, 16), (1, 17), (9, 40), (1, 300), (1, 2)]


@pytest.fixture(scope="module")
def kernel() -> cpu_native.DecodeKernel:
    built = cpu_native.decode_kernel()
    assert built is not None, "the C kernel did not build (is a C compiler installed?)"
    return built


def _attend(query: torch.Tensor, cache: torch.Tensor, metadata, scale: float) -> torch.Tensor:  # type: ignore[no-untyped-def]
    backend = TorchAttentionBackend()
    plan = backend.prepare(metadata, cache.shape[2], cache.shape[3], query.dtype)
    assert plan.native is not None and plan.decode_groups is None  # the kernel's path
    return backend.attend(query, cache, metadata, plan, scale)


@pytest.mark.parametrize("block_size", [16, 1, 5, 32])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 4, 16), (8, 2, 64), (8, 1, 24)])
def test_float32_matches_pytorch(kernel: cpu_native.DecodeKernel, block_size: int, heads: int,
                                 kv_heads: int, head_dim: int) -> None:
    query, cache, metadata = ragged_batch(block_size, heads, kv_heads, torch.float32,
                                          seed=block_size + heads, head_dim=head_dim,
                                          batch=DECODE_HEAVY)
    got = _attend(query, cache, metadata, 0.3)
    # float32 sums in another order: within a few ulps of outputs of magnitude ~5.
    torch.testing.assert_close(got, torch_reference(query, cache, metadata, 0.3),
                               rtol=1e-5, atol=5e-5)


def test_bfloat16_is_as_close_to_float32_as_pytorchs_bfloat16(
        kernel: cpu_native.DecodeKernel) -> None:
    query, cache, metadata = ragged_batch(16, 8, 4, torch.bfloat16, seed=7, head_dim=64,
                                          batch=DECODE_HEAVY)
    exact = torch_reference(query, cache, metadata, 0.125)
    got = _attend(query, cache, metadata, 0.125)
    backend = TorchAttentionBackend(c_kernel=False)
    pytorch = backend.attend(query, cache, metadata,
                             backend.prepare(metadata, 16, 4, torch.bfloat16), 0.125)
    assert got.dtype == torch.bfloat16
    assert (got.float() - exact).abs().max() <= (pytorch.float() - exact).abs().max()


def test_rows_shared_among_threads_give_the_same_bits(kernel: cpu_native.DecodeKernel) -> None:
    query, cache, metadata = ragged_batch(16, 8, 2, torch.float32, seed=3, head_dim=32,
                                          batch=[(1, n) for n in range(1, 200, 7)])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = _attend(query, cache, metadata, 0.2)
        torch.set_num_threads(3)
        split = _attend(query, cache, metadata, 0.2)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, split)


def test_a_strided_query_view(kernel: cpu_native.DecodeKernel) -> None:
    query, cache, metadata = ragged_batch(16, 4, 2, torch.float32, seed=5, head_dim=16,
                                          batch=DECODE_HEAVY)
    fused = torch.cat([query, torch.full_like(query, 1e4)], dim=1)  # q beside other heads
    got = _attend(fused[:, :4], cache, metadata, 0.5)
    assert (got - torch_reference(query, cache, metadata, 0.5)).abs().max().item() < 1e-5


def test_a_head_shape_past_the_kernels_limits_uses_pytorch(
        kernel: cpu_native.DecodeKernel) -> None:
    query, cache, metadata = ragged_batch(16, 128, 2, torch.float32, seed=2, head_dim=8,
                                          batch=DECODE_HEAVY)
    assert not kernel.fits(torch.float32, 128, 2, 8, 16)  # 128 query heads in one call
    got = _attend(query, cache, metadata, 0.3)
    assert (got - torch_reference(query, cache, metadata, 0.3)).abs().max().item() < 1e-5


def test_without_a_compiler_pytorch_runs_and_the_log_says_why(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with fresh_build(monkeypatch, tmp_path, cpu_native.decode_kernel, compiler=False):
        with caplog.at_level(logging.WARNING, logger=cpu_native.__name__):
            assert cpu_native.decode_kernel() is None
        assert "PyTorch's ops run instead" in caplog.text
        query, cache, metadata = ragged_batch(16, 4, 2, torch.float32, seed=1, head_dim=16)
        backend = TorchAttentionBackend()
        plan = backend.prepare(metadata, 16, 2, torch.float32)
        assert plan.native is None and plan.decode_groups
        got = backend.attend(query, cache, metadata, plan, 0.3)
        assert (got - torch_reference(query, cache, metadata, 0.3)).abs().max().item() < 1e-5


def test_choosing_the_cpu_backend_builds_the_kernel_before_any_step(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # A fresh cache directory: the first request's step would otherwise pay the compile.
    with fresh_build(monkeypatch, tmp_path, cpu_native.decode_kernel) as built:
        choice = select_attention_backend("cpu", torch.bfloat16, 16)
        assert choice.backend.name == "torch"
        assert cpu_native.decode_kernel.cache_info().currsize == 1
        assert list(built.glob("cpu_decode-*.so"))
