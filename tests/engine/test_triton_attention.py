"""pdserve's Triton paged-attention kernel: its cases under Triton's interpreter (on CPU, in a
process of their own), the compiled kernel against the torch backend on a GPU, and the rule that
picks a backend per device.

The interpreter is never set in this process: Triton decides per decorated function whether it
is interpreted, so under `pytest -m gpu` the kernel these tests reach is the compiled one.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.engine.attention import choose_backend
from tests.engine.attention_batches import ragged_batch, torch_reference

ROOT = Path(__file__).resolve().parents[2]
HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (pip install triton)")
@pytest.mark.timeout(600)
def test_kernel_cases_pass_under_the_interpreter_in_a_process_of_their_own() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-o", "python_files=cases_*.py", "tests/engine/triton_interpreted"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=560)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("dtype", "tolerance"),
                         [(torch.float32, 1e-4), (torch.float16, 2e-2), (torch.bfloat16, 6e-2)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_compiled_kernel_matches_torch_backend_on_a_ragged_batch(
        dtype: torch.dtype, tolerance: float, block_size: int) -> None:
    from pdserve.engine.attention.triton_backend import TritonAttentionBackend

    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "the interpreter would be tested"
    query, cache, metadata = ragged_batch(block_size, 8, 2, dtype, seed=7, head_dim=128,
                                          device="cuda")
    expected = torch_reference(query, cache, metadata, 0.1)
    actual = TritonAttentionBackend().attend(query, cache, metadata, None, 0.1)
    assert actual.dtype == dtype
    assert (actual.float() - expected).abs().max().item() < tolerance


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_kernel_splits_long_decode_contexts_and_matches_torch(dtype: torch.dtype) -> None:
    from pdserve.engine.attention.triton_backend import TritonAttentionBackend
    from pdserve.engine.attention.triton_kernel import launch_shape

    batch = [(1, 3000), (1, 700), (1, 1), (1, 2049)]
    query, cache, metadata = ragged_batch(16, 8, 2, dtype, seed=9, head_dim=128, device="cuda",
                                          batch=batch)
    wanted = 2 * torch.cuda.get_device_properties(0).multi_processor_count
    assert launch_shape(len(batch), 2, 4, 1, 3000, wanted).num_splits > 1  # the split path
    expected = torch_reference(query, cache, metadata, 0.1)
    actual = TritonAttentionBackend().attend(query, cache, metadata, None, 0.1)
    assert (actual.float() - expected).abs().max().item() < (1e-4 if dtype == torch.float32
                                                            else 6e-2)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (pip install triton)")
def test_launch_shape_splits_long_contexts_only_where_programs_are_too_few() -> None:
    from pdserve.engine.attention.triton_kernel import (
        BLOCK_M,
        MAX_SPLITS,
        PREFILL_BLOCK_M,
        launch_shape,
    )

    h200 = 2 * 132  # two programs per SM
    # One decode row over 32k tokens, 8 KV heads: 8 programs would leave 124 SMs idle.
    one = launch_shape(1, 8, 4, 1, 32768, h200)
    assert (one.block_m, one.num_splits, one.kv_chunk) == (BLOCK_M, MAX_SPLITS, 2048)
    mid = launch_shape(8, 8, 4, 1, 3000, h200)  # 64 programs: 5 splits of 608 tokens
    assert (mid.num_splits, mid.kv_chunk) == (5, 608) and mid.num_splits * mid.kv_chunk >= 3000
    assert launch_shape(128, 8, 4, 1, 32768, h200).num_splits == 1  # the batch fills the GPU
    assert launch_shape(1, 8, 4, 1, 300, h200).num_splits == 1  # too short to be worth it
    assert launch_shape(1, 8, 4, 1, 32768, 1).num_splits == 1  # the interpreter (CPU)
    prompt = launch_shape(1, 8, 4, 512, 8192, h200)  # a prompt chunk: large tiles, no split
    assert (prompt.block_m, prompt.num_splits) == (PREFILL_BLOCK_M, 1)


def test_backend_rule_per_device_dtype_block_size_and_capability() -> None:
    bf16 = torch.bfloat16
    assert choose_backend("cpu", bf16, 16, None, None, None).name == "torch"
    ampere = (8, 0)
    assert choose_backend("cuda", bf16, 256, ampere, None, None).name == "flash-attn"
    # Block 16: flash-attn's paged kernel refuses it, so Triton serves it without a copy.
    small = choose_backend("cuda", bf16, 16, ampere, None, None)
    assert small.name == "triton" and "multiples of 256" in small.reason
    turing = choose_backend("cuda", bf16, 256, (7, 5), None, None)
    assert turing.name == "triton" and "compute capability >= 8.0" in turing.reason
    assert "7.5" in turing.reason
    assert choose_backend("cuda", torch.float32, 256, ampere, None, None).name == "triton"
    missing = choose_backend("cuda", bf16, 256, ampere, "it did not import", None)
    assert missing.name == "triton" and "did not import" in missing.reason
    unknown = choose_backend("cuda", bf16, None, ampere, None, None)  # a model loaded alone
    assert unknown.name == "triton" and "no KV block size" in unknown.reason
    neither = choose_backend("cuda", bf16, 16, ampere, None, "it did not import")
    assert neither.name == "torch" and "Triton is unusable" in neither.reason
