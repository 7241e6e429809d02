"""`gpu_check.py`'s measured stages on a CUDA GPU: backend parity against transformers, a
two-process handoff, and engine prefill and decode rates, each figure reported against its bound.

Floors are set where a figure below them means a defect (a stall, a wrong kernel, a fallback),
not where tuning would take it; a figure above its bound fails too (a wrong measurement).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from benchmarks.gpu_report import Report

# Dense bf16 tensor-core FLOP/s and HBM bytes/s from the vendors' data sheets, by name part.
PEAKS = {"H200": (989e12, 4.8e12), "H100": (989e12, 3.35e12), "A100": (312e12, 2.0e12),
         "A10G": (70e12, 0.6e12), "L40S": (362e12, 0.864e12), "L4": (121e12, 0.3e12)}
# Llama-3-8B's shape (make-model size flags), with room for the 8,192-token prompt and its
# answer: the preset's 4,096 positions would refuse the prompt.
LLAMA3_8B = {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
             "num_layers": 32, "num_heads": 32, "num_kv_heads": 8,
             "max_position_embeddings": 8192 + 64}
PREFILL_TOKENS = 8192
# The smallest ratio to its bound that passes, per figure.
FLOORS = {"prefill": 0.2, "decode": 0.1, "handoff": 0.02}
DECODE_BATCHES = (1, 32, 128)


def peaks() -> tuple[float, float, str]:
    name = torch.cuda.get_device_name()
    for part, (flops, bandwidth) in PEAKS.items():
        if part in name:
            return flops, bandwidth, f"{name}: data-sheet peaks"
    return measured_matmul_flops(), copy_bandwidth(), f"{name}: measured peaks (not in table)"


def measured_matmul_flops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
    return 20 * 2 * 8192**3 / (time.perf_counter() - start)


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy, bytes moved (read + written) per second."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 10 * 2 * nbytes / (time.perf_counter() - start)


def backend_parity(report: Report, model_dir: Path) -> None:
    """Logits and greedy tokens of every CUDA backend against transformers (tiny Llama, bf16)."""
    from transformers import AutoModelForCausalLM

    from pdserve.engine.attention import TorchAttentionBackend
    from pdserve.engine.attention.selection import probe_flash_attn, probe_triton
    from pdserve.engine.checkpoint import load_model

    backends: dict[str, type | None] = {"torch": TorchAttentionBackend}
    triton_problem = probe_triton()
    if triton_problem is None:
        from pdserve.engine.attention.triton_backend import TritonAttentionBackend

        backends["triton"] = TritonAttentionBackend
    else:
        report.skipped("parity", "triton", f"Triton unusable: {triton_problem}")
    flash_problem = probe_flash_attn()
    if flash_problem is None and torch.cuda.get_device_capability() >= (8, 0):
        backends["flash-attn"] = None  # chosen by the loader at block size 256
    else:
        report.skipped("parity", "flash-attn", f"not installed or unusable ({flash_problem}); "
                       "needs a flash-attn wheel built for this torch")
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    prompt = torch.randint(0, 1000, (200,), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.inference_mode():
        want = reference(prompt[None]).logits[0].float()
    for name, backend in backends.items():
        block_size = 256 if backend is None else 16
        model, _ = load_model(model_dir, torch.bfloat16, "cuda", block_size=block_size)
        if backend is not None:
            model.attention_backend = backend()
        logits = _forward(model, prompt, block_size)
        diff = (logits - want).abs().max().item()
        agree = (logits.argmax(-1) == want.argmax(-1)).float().mean().item()
        report.ratio("parity", f"{name} vs transformers max |logit diff|", diff, 0.5, "",
                     floor=0.0, ceiling=1.0)
        report.ratio("parity", f"{name} vs transformers greedy agreement", agree, 1.0, "",
                     floor=0.98, ceiling=1.0)


def _forward(model: torch.nn.Module, prompt: torch.Tensor, block_size: int) -> torch.Tensor:
    from pdserve.engine.attention import AttentionMetadata

    c = model.config
    n = prompt.numel()
    blocks = -(-n // block_size)
    cache = torch.zeros(c.num_layers, 2, blocks, block_size, c.num_kv_heads, c.head_dim,
                        dtype=torch.bfloat16, device="cuda")
    metadata = AttentionMetadata.build([n], [n], [list(range(blocks))], block_size, "cuda")
    with torch.inference_mode():
        hidden = model(prompt, torch.arange(n, device="cuda"), cache, metadata)
        return model.compute_logits(hidden)


def handoff_ratio(report: Report) -> None:
    """Two processes on one GPU: byte-exact, GB/s against a device-to-device copy."""
    from pdserve.engine.kv.layout import KVLayout
    from tests.handoff.handoff_agent import running_agents

    layout = KVLayout("check", "bfloat16", block_size=16, num_layers=32, num_kv_heads=8,
                      head_dim=128)  # Llama-3-8B: 4 MiB per block across layers
    num_blocks = 128  # 2,048 tokens, 256 MiB
    big = {"receiver_staging_bytes": 512 << 20, "sender_staging_bytes": 512 << 20,
           "max_piece_bytes": 16 << 20, "min_piece_bytes": 4 << 20, "timeout_s": 60.0}
    ids = list(range(num_blocks))
    with running_agents(big, big) as (receiver, sender):
        for agent, seed in ((receiver, 1), (sender, 2)):
            agent.call("make_cache", layout=layout.to_dict(), num_blocks=num_blocks + 8,
                       seed=seed, device="cuda")
        receiver.call("make_receiver")
        sender.call("make_sender")
        seconds = []
        for rep in range(4):  # the first warms links and staging
            ticket = receiver.call("reserve", request_id=f"bw{rep}", block_ids=ids,
                                   num_tokens=num_blocks * 16 - 1)
            start = time.perf_counter()
            handle = sender.call("push", tickets=[ticket], block_ids=[ids],
                                 first_token_id=1)["handles"][0]
            ready = receiver.call("wait", request_id=f"bw{rep}", timeout=60)
            seconds.append(time.perf_counter() - start)
            sent = sender.call("result", handle=handle, timeout=60)
            if not report.passed("handoff", f"transfer {rep} fenced and released",
                                 bool(ready["ok"] and sent["ok"]), f"{ready} / {sent}"):
                return
        exact = receiver.call("blocks_digest", block_ids=ids) == \
            sender.call("blocks_digest", block_ids=ids)
        report.passed("handoff", "byte-exact (digest of every block on both sides)", exact)
    nbytes = num_blocks * layout.num_layers * layout.block_bytes
    report.ratio("handoff", "GB/s vs device-to-device copy", nbytes / min(seconds[1:]) / 1e9,
                 copy_bandwidth() / 2 / 1e9, "GB/s", FLOORS["handoff"])


def engine_ratios(report: Report, model_dir: Path, flops: float, bandwidth: float) -> None:
    """Prefill of one 8k prompt against the FLOP bound; decode at several batch sizes against
    the (weights + KV) / HBM-bandwidth bound."""
    from pdserve.cluster.config import engine_config
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.kv.cache import kv_bytes_per_token
    from pdserve.engine.sampling_params import SamplingParams

    engine = LLMEngine(engine_config(str(model_dir), dtype="bfloat16",
                                     max_model_len=PREFILL_TOKENS + 64, device="cuda",
                                     max_num_batched_tokens=PREFILL_TOKENS,
                                     max_num_seqs=max(DECODE_BATCHES),
                                     enable_prefix_caching=False))
    report.say(engine.describe())
    report.facts["engine"] = engine.describe()
    parameters = list(engine.loaded.model.parameters())
    params = sum(p.numel() for p in parameters)
    weight_bytes = sum(p.numel() * p.element_size() for p in parameters)
    per_token = kv_bytes_per_token(engine.loaded.config, "bfloat16")
    once = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.generate([[1] * 512], once)  # warm-up
    n = PREFILL_TOKENS
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.generate([[(i * 7) % 1000 + 1 for i in range(n)]], once)
    seconds = time.perf_counter() - start
    c = engine.loaded.config
    attention = 2 * c.num_layers * n * n * c.num_heads * c.head_dim  # causal QK^T and PV
    report.ratio("engine", "prefill tok/s at 8k vs FLOP bound", n / seconds,
                 n / ((2 * params * n + attention) / flops), "tok/s", FLOORS["prefill"])
    for batch in DECODE_BATCHES:
        prompts = [[(b * 13 + i) % 1000 + 1 for i in range(128)] for b in range(batch)]
        steps = 64
        decode = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
        engine.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.generate(prompts, decode)
        seconds = time.perf_counter() - start
        context = 128 + steps // 2
        step_bytes = weight_bytes + batch * context * per_token
        report.ratio("engine", f"decode tok/s at batch {batch} vs (weights + KV)/HBM bound",
                     batch * steps / seconds, batch / (step_bytes / bandwidth), "tok/s",
                     FLOORS["decode"])
