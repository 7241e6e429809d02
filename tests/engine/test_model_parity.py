"""Logits of pdserve's paged CausalLM equal transformers' full forward on the same checkpoints.

Covers whole prompts in one step, chunked prompts then decode steps through shuffled blocks, the
layer hook's timing, and every CUDA backend (flash-attn, Triton, torch) against the torch
backend and transformers (GPU only).
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.attention import AttentionMetadata, TorchAttentionBackend
from pdserve.engine.checkpoint import load_model
from pdserve.engine.models import CausalLM
from tests.engine.paged_runs import garbage_cache, run_schedule, run_step, shuffled_block_tables

LENGTHS = [1, 7, 33, 100]
TOLERANCE = 1e-4
FAMILIES = ["llama", "qwen2", "qwen2_tied"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def models(tiny_checkpoints: dict[str, str], family: str) -> tuple[CausalLM, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    ours, _ = load_model(tiny_checkpoints[family], torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(
        tiny_checkpoints[family], dtype=torch.float32
    ).eval()
    return ours, reference  # type: ignore[return-value]


@pytest.fixture(scope="module")
def prompts(models: tuple[CausalLM, torch.nn.Module]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    vocab = models[0].config.vocab_size
    return [torch.randint(0, vocab, (n,), generator=generator) for n in LENGTHS]


@pytest.fixture(scope="module")
def reference_logits(
    models: tuple[CausalLM, torch.nn.Module], prompts: list[torch.Tensor]
) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [models[1](p[None]).logits[0].float() for p in prompts]


@pytest.mark.parametrize("block_size", [4, 16])
def test_whole_prompts_in_one_step(models, prompts, reference_logits, block_size: int) -> None:
    model = models[0]
    tables, num_blocks = shuffled_block_tables(LENGTHS, block_size, seed=block_size)
    cache = garbage_cache(model, num_blocks, block_size)
    spans = [(s, 0, n) for s, n in enumerate(LENGTHS)]
    for (s, _, _), logits in zip(
        spans, run_step(model, cache, prompts, spans, tables, block_size), strict=True
    ):
        diff = (logits - reference_logits[s]).abs().max().item()
        assert diff <= TOLERANCE, f"sequence of {LENGTHS[s]} tokens: max |logit diff| {diff:.2e}"


@pytest.mark.parametrize("block_size", [4, 16])
def test_chunked_prefill_then_decode(models, prompts, reference_logits, block_size: int) -> None:
    model = models[0]
    tables, num_blocks = shuffled_block_tables(LENGTHS, block_size, seed=100 + block_size)
    cache = garbage_cache(model, num_blocks, block_size)
    logits, saw_mixed_batch = run_schedule(model, cache, prompts, tables, block_size)
    assert saw_mixed_batch, "the schedule should mix decode rows and prefill chunks in one step"
    for s, seq_logits in enumerate(logits):
        diff = (seq_logits - reference_logits[s]).abs().max().item()
        assert diff <= TOLERANCE, f"sequence of {LENGTHS[s]} tokens: max |logit diff| {diff:.2e}"


def test_decode_batch_matches_one_by_one(models, prompts) -> None:
    """The vectorised decode path gives each sequence what it gets alone."""
    model, block_size = models[0], 4
    tables, num_blocks = shuffled_block_tables(LENGTHS, block_size, seed=5)
    cache = garbage_cache(model, num_blocks, block_size)
    prefix = [(s, 0, n - 1) for s, n in enumerate(LENGTHS) if n > 1]
    run_step(model, cache, prompts, prefix, tables, block_size)
    batched = run_step(
        model, cache, prompts, [(s, n - 1, n) for s, n in enumerate(LENGTHS)], tables, block_size
    )
    for s, n in enumerate(LENGTHS):
        alone = run_step(model, cache, prompts, [(s, n - 1, n)], tables, block_size)[0]
        assert torch.allclose(batched[s], alone, atol=TOLERANCE, rtol=0)


def test_decode_rows_in_several_length_groups_match_one_by_one(
    models, prompts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows of interleaved lengths split into groups (no cost per group), next to a prefill
    chunk: each row still gets what it gets alone."""
    from pdserve.engine.attention import torch_backend

    monkeypatch.setattr(torch_backend, "_GROUP_COST_BLOCKS", 0)
    model, block_size = models[0], 4
    # The grouped PyTorch path (the C kernel takes CPU decode rows by default).
    monkeypatch.setattr(model, "attention_backend", TorchAttentionBackend(c_kernel=False))
    order = [3, 1, 2, 0]  # long, short, middle, shortest: every group is out of batch order
    tables, num_blocks = shuffled_block_tables(LENGTHS, block_size, seed=11)
    cache = garbage_cache(model, num_blocks, block_size)
    run_step(model, cache, prompts, [(s, 0, n - 1) for s, n in enumerate(LENGTHS) if n > 1],
             tables, block_size)
    decodes = [(s, LENGTHS[s] - 1, LENGTHS[s]) for s in order if LENGTHS[s] > 1]
    plan = model.attention_backend.prepare(
        AttentionMetadata.build([1] * len(decodes), [stop for _, _, stop in decodes],
                                [tables[s] for s, _, _ in decodes], block_size, "cpu"),
        block_size, model.config.num_kv_heads, torch.float32)
    assert len(plan.decode_groups) == len(decodes)
    batched = run_step(model, cache, prompts, decodes + [(0, 0, 1)], tables, block_size)
    for (s, start, stop), got in zip(decodes + [(0, 0, 1)], batched, strict=True):
        alone = run_step(model, cache, prompts, [(s, start, stop)], tables, block_size)[0]
        assert torch.allclose(got, alone, atol=TOLERANCE, rtol=0), f"sequence {s}"


def test_layer_hook_fires_after_each_layers_kv_write(models, prompts) -> None:
    model, block_size = models[0], 16
    lengths = [33, 7]
    tables, num_blocks = shuffled_block_tables(lengths, block_size, seed=9)
    c = model.config
    cache = torch.zeros(c.num_layers, 2, num_blocks, block_size, c.num_kv_heads, c.head_dim)
    metadata = AttentionMetadata.build(lengths, lengths, tables, block_size, "cpu")
    flat = cache.view(c.num_layers, 2, num_blocks * block_size, c.num_kv_heads, c.head_dim)
    fired: list[int] = []

    def hook(layer: int) -> None:
        written = flat[layer][:, metadata.slot_mapping]
        assert bool((written != 0).any(dim=(2, 3)).all()), (
            f"layer {layer}: K/V not written when the hook fired"
        )
        if layer + 1 < c.num_layers:
            assert bool((flat[layer + 1] == 0).all()), (
                f"layer {layer + 1} written before hook({layer})"
            )
        fired.append(layer)

    input_ids = torch.cat([prompts[2][:33], prompts[1][:7]])
    positions = torch.cat([torch.arange(33), torch.arange(7)])
    model(input_ids, positions, cache, metadata, layer_hook=hook)
    assert fired == list(range(c.num_layers))


def test_metadata_build_slots_and_offsets() -> None:
    metadata = AttentionMetadata.build([2, 1], [5, 3], [[7, 2], [4]], block_size=4, device="cpu")
    # Sequence 0 writes positions 3, 4 -> block 7 offset 3, block 2 offset 0; sequence 1 position 2.
    assert metadata.slot_mapping.tolist() == [7 * 4 + 3, 2 * 4 + 0, 4 * 4 + 2]
    assert metadata.query_start_loc.tolist() == [0, 2, 3]
    assert metadata.seq_lens_tensor.tolist() == [5, 3]
    assert metadata.block_tables.dtype == torch.int32 and metadata.block_tables.shape == (2, 2)
    assert (metadata.max_query_len, metadata.max_seq_len) == (2, 5)
    with pytest.raises(ValueError, match="cannot hold"):
        AttentionMetadata.build([1], [5], [[0]], block_size=4, device="cpu")


def _flash_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def _cuda_backends() -> list[str]:
    """The CUDA backends this machine can run besides torch."""
    if not torch.cuda.is_available():
        return []
    names = []
    if _flash_available() and torch.cuda.get_device_capability() >= (8, 0):
        names.append("flash-attn")
    try:
        import triton  # noqa: F401
    except ImportError:
        return names
    return [*names, "triton"]


def _make_backend(name: str):
    if name == "flash-attn":
        from pdserve.engine.attention.flash_backend import FlashAttentionBackend

        return FlashAttentionBackend()
    from pdserve.engine.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_backends(), reason="needs a CUDA GPU with flash-attn or Triton")
@pytest.mark.parametrize(("name", "block_size"), [("flash-attn", 256), ("triton", 16),
                                                  ("triton", 256)])
def test_cuda_backend_matches_torch_backend(
    tiny_checkpoints: dict[str, str], name: str, block_size: int
) -> None:
    if name not in _cuda_backends():
        pytest.skip(f"{name} is not usable on this GPU")
    model, config = load_model(tiny_checkpoints["llama"], torch.bfloat16, "cuda",
                               block_size=block_size)
    generator = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(0, config.vocab_size, (n,), generator=generator).cuda() for n in LENGTHS
    ]
    tables, num_blocks = shuffled_block_tables(LENGTHS, block_size, seed=2)
    results = []
    for backend in (_make_backend(name), TorchAttentionBackend()):
        model.attention_backend = backend
        cache = torch.zeros(
            config.num_layers,
            2,
            num_blocks,
            block_size,
            config.num_kv_heads,
            config.head_dim,
            dtype=torch.bfloat16,
            device="cuda",
        )
        logits, _ = run_schedule(model, cache, prompts, tables, block_size)
        results.append(torch.cat(logits))
    # bf16 kernels differ in summation order; require close logits and (nearly) equal argmax.
    assert (results[0] - results[1]).abs().max().item() < 0.5
    assert (results[0].argmax(-1) == results[1].argmax(-1)).float().mean().item() > 0.98


def test_backend_selection_on_cpu_is_torch() -> None:
    from pdserve.engine.attention import select_attention_backend

    choice = select_attention_backend("cpu", torch.float32, 16)
    assert isinstance(choice.backend, TorchAttentionBackend)
    assert "cpu" in choice.reason


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["torch", "triton"])
def test_cuda_backends_in_float32_match_transformers(tiny_checkpoints: dict[str, str],
                                                     name: str) -> None:
    from transformers import AutoModelForCausalLM

    if name == "triton" and "triton" not in _cuda_backends():
        pytest.skip("Triton is not installed")
    model, config = load_model(tiny_checkpoints["qwen2"], torch.float32, "cuda")
    model.attention_backend = TorchAttentionBackend() if name == "torch" else _make_backend(name)
    reference = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["qwen2"], dtype=torch.float32)
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=generator) for n in LENGTHS]
    with torch.inference_mode():
        expected = [reference.eval()(p[None]).logits[0] for p in prompts]
    block_size = 4
    tables, num_blocks = shuffled_block_tables(LENGTHS, block_size, seed=8)
    cache = garbage_cache(model, num_blocks, block_size).cuda()
    logits, _ = run_schedule(model, cache, [p.cuda() for p in prompts], tables, block_size)
    for got, want in zip(logits, expected, strict=True):
        assert (got.cpu() - want).abs().max().item() < 1e-3  # TF32 or kernel order may differ


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_torch_backend_on_cuda_never_needs_the_math_kernel(
        tiny_checkpoints: dict[str, str]) -> None:
    """Prompt chunks after a cached prefix (masked) with GQA: SDPA must find a fused kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model, config = load_model(tiny_checkpoints["qwen2"], torch.bfloat16, "cuda")
    model.attention_backend = TorchAttentionBackend()
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=generator).cuda()
               for n in LENGTHS]
    tables, num_blocks = shuffled_block_tables(LENGTHS, 16, seed=3)
    cache = garbage_cache(model, num_blocks, 16).to(torch.bfloat16).cuda()
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION]):
        logits, _ = run_schedule(model, cache, prompts, tables, 16)  # raises if only math fits
    assert all(torch.isfinite(x).all() for x in logits)
