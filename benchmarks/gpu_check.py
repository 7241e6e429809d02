"""The one GPU check: runs pdserve's GPU tests, then measures each CUDA path against its bound and
prints every figure as a ratio to that bound. One GPU, no network, no Ray, under 8 minutes.

    .venv/bin/python benchmarks/gpu_check.py [--skip-tests] [--model-dir DIR]

On a machine without a CUDA GPU it says so and exits 0. Exit status 1: a test or a parity
check failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# Dense bf16 tensor-core FLOP/s and HBM bytes/s from the vendors' data sheets, by name part.
PEAKS = {"H200": (989e12, 4.8e12), "H100": (989e12, 3.35e12), "A100": (312e12, 2.0e12),
         "A10G": (70e12, 0.6e12), "L40S": (362e12, 0.864e12), "L4": (121e12, 0.3e12)}
# Llama-3-8B's shape (make-model size flags), with room for the 8,192-token prompt and its
# answer: the preset's 4,096 positions would refuse the prompt.
LLAMA3_8B = {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
             "num_layers": 32, "num_heads": 32, "num_kv_heads": 8,
             "max_position_embeddings": 8192 + 64}


def line(name: str, value: float, bound: float, unit: str) -> None:
    print(f"{name}: {value:,.1f} {unit} / bound {bound:,.1f} {unit} = {value / bound:.2f}",
          flush=True)


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


def run_gpu_tests() -> bool:
    print("== GPU tests (pytest -m gpu)", flush=True)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-m", "gpu",
                             "tests/engine", "tests/handoff"], cwd=ROOT, timeout=240)
    return result.returncode == 0


def backend_parity(model_dir: Path) -> bool:
    """Logits and greedy tokens of every CUDA backend against the torch path and transformers."""
    from transformers import AutoModelForCausalLM

    from pdserve.engine.attention import TorchAttentionBackend
    from pdserve.engine.attention.selection import probe_flash_attn, probe_triton
    from pdserve.engine.checkpoint import load_model

    print("== backend parity (tiny Llama, bf16)", flush=True)
    backends = {"torch": TorchAttentionBackend}
    if probe_triton() is None:
        from pdserve.engine.attention.triton_backend import TritonAttentionBackend

        backends["triton"] = TritonAttentionBackend
    flash = probe_flash_attn() is None and torch.cuda.get_device_capability() >= (8, 0)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    prompt = torch.randint(0, 1000, (200,), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.inference_mode():
        want = reference(prompt[None]).logits[0].float()
    ok = True
    for name, block_size in [(n, 16) for n in backends] + ([("flash-attn", 256)] if flash else []):
        model, _ = load_model(model_dir, torch.bfloat16, "cuda", block_size=block_size)
        if name in backends:
            model.attention_backend = backends[name]()
        logits = _forward(model, prompt, block_size)
        diff = (logits - want).abs().max().item()
        agree = (logits.argmax(-1) == want.argmax(-1)).float().mean().item()
        line(f"{name} vs transformers max |logit diff|", diff, 0.5, "")
        line(f"{name} vs transformers greedy agreement", agree, 1.0, "")
        ok &= diff < 0.5 and agree > 0.98
    return ok


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


def handoff_ratio() -> None:
    """Two processes on one GPU: byte-exact, GB/s against a device-to-device copy."""
    sys.path[:0] = [str(ROOT)]
    from pdserve.engine.kv_layout import KVLayout
    from tests.handoff.handoff_agent import running_agents

    print("== handoff, two processes on one GPU", flush=True)
    layout = KVLayout("check", "bfloat16", block_size=16, num_layers=32, num_kv_heads=8,
                      head_dim=128)  # Llama-3-8B: 4 MiB per block across layers
    num_blocks = 128  # 2,048 tokens, 256 MiB
    big = {"receiver_staging_bytes": 512 << 20, "sender_staging_bytes": 512 << 20,
           "max_piece_bytes": 16 << 20, "min_piece_bytes": 4 << 20, "timeout_s": 60.0}
    with running_agents(big, big) as (receiver, sender):
        for agent, seed in ((receiver, 1), (sender, 2)):
            agent.call("make_cache", layout=layout.to_dict(), num_blocks=num_blocks + 8,
                       seed=seed, device="cuda")
        receiver.call("make_receiver")
        sender.call("make_sender")
        seconds = []
        for rep in range(4):  # the first warms links and staging
            ids = list(range(num_blocks))
            ticket = receiver.call("reserve", request_id=f"bw{rep}", block_ids=ids,
                                   num_tokens=num_blocks * 16 - 1)
            start = time.perf_counter()
            handle = sender.call("push", tickets=[ticket], block_ids=[ids],
                                 first_token_id=1)["handles"][0]
            assert receiver.call("wait", request_id=f"bw{rep}", timeout=60)["ok"]
            seconds.append(time.perf_counter() - start)
            assert sender.call("result", handle=handle, timeout=60)["ok"]
        exact = receiver.call("blocks_digest", block_ids=ids) == \
            sender.call("blocks_digest", block_ids=ids)
        print(f"handoff byte-exact: {exact}")
        nbytes = num_blocks * layout.num_layers * layout.block_bytes
        line("handoff GB/s vs device-to-device copy", nbytes / min(seconds[1:]) / 1e9,
             copy_bandwidth() / 2 / 1e9, "GB/s")


def engine_ratios(model_dir: Path, flops: float, bandwidth: float) -> None:
    from pdserve.cluster.config import engine_config
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.kv_cache import kv_bytes_per_token
    from pdserve.engine.sampling_params import SamplingParams

    print("== engine, Llama-3-8B-shaped random bf16 checkpoint", flush=True)
    engine = LLMEngine(engine_config(str(model_dir), dtype="bfloat16", max_model_len=8192 + 64,
                                     device="cuda", max_num_batched_tokens=8192,
                                     max_num_seqs=128, enable_prefix_caching=False))
    print(engine.describe())
    params = sum(p.numel() for p in engine.loaded.model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.loaded.model.parameters())
    per_token = kv_bytes_per_token(engine.loaded.config, "bfloat16")
    once = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.generate([[1] * 512], once)  # warm-up
    n = 8192
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.generate([[(i * 7) % 1000 + 1 for i in range(n)]], once)
    seconds = time.perf_counter() - start
    c = engine.loaded.config
    attention = 2 * c.num_layers * n * n * c.num_heads * c.head_dim  # causal QK^T and PV
    line("prefill tok/s at 8k vs FLOP bound", n / seconds,
         n / ((2 * params * n + attention) / flops), "tok/s")
    for batch in (1, 32, 128):
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
        line(f"decode tok/s at batch {batch} vs (weights + KV)/HBM bound",
             batch * steps / seconds, batch / (step_bytes / bandwidth), "tok/s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="reuse a Llama-3-8B-shaped checkpoint made by an earlier run")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU found (torch.cuda.is_available() is False); nothing to "
              "check on this machine")
        return 0
    from pdserve.engine.checkpoint_maker import make_checkpoint

    flops, bandwidth, source = peaks()
    print(f"gpu_check: {source}: {flops / 1e12:.0f} TFLOP/s bf16, {bandwidth / 1e12:.2f} TB/s")
    ok = args.skip_tests or run_gpu_tests()
    with tempfile.TemporaryDirectory() as tmp:
        tiny = make_checkpoint(Path(tmp) / "tiny", "llama", "tiny", dtype="bfloat16")
        ok &= backend_parity(tiny)
        handoff_ratio()
        model_dir = args.model_dir or Path(tmp) / "llama3-8b-shape"
        if not (model_dir / "config.json").exists():
            print("making the Llama-3-8B-shaped checkpoint (random bf16 weights)", flush=True)
            make_checkpoint(model_dir, "llama", "medium", dtype="bfloat16", shape=LLAMA3_8B)
        engine_ratios(model_dir, flops, bandwidth)
    print("gpu_check: " + ("all checks passed" if ok else "a check FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
