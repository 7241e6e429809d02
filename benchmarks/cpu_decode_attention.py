"""pdserve's C decode-attention kernel against the PyTorch ops path, in the offline engine's
decode step: the medium checkpoint (bf16), batches of 1, 32 and 64, one and two threads.

Each batch decodes 256 tokens after 112-token prompts (contexts 112-368); the two paths
alternate per round in one process, so drift in the machine's load falls on both alike. The
figure is the median step over the rounds' decode steps (the prefill step left out).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch
from _common import (  # run as a script: python benchmarks/cpu_decode_attention.py
    DEFAULT_MODEL_DIR,
    bar_chart,
    ensure_checkpoint,
    offline,
    save_json,
    set_threads,
)

from pdserve.cluster.config import engine_config
from pdserve.engine.attention import TorchAttentionBackend
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams

PROMPT_TOKENS, OUTPUT_TOKENS = 112, 256


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 64])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=2)
    return p.parse_args()


def decode_steps(engine: LLMEngine, batch: int, seed: int) -> list[float]:
    """Seconds of each decode step of one batch run to the end (greedy, EOS ignored)."""
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{seed}-{i}", [rng.randrange(3, 1000) for _ in range(PROMPT_TOKENS)],
                           params)
    engine.step()  # the prompts
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return steps


def main() -> None:
    args = parse_args()
    offline()
    path = ensure_checkpoint(DEFAULT_MODEL_DIR, "llama", "medium", dtype="bfloat16")
    results: dict[str, dict[str, dict[str, float]]] = {}
    for threads in args.threads:
        print(set_threads(threads))
        most = max(args.batches)
        engine = LLMEngine(engine_config(str(path), dtype="bfloat16", max_num_seqs=most,
                                         num_kv_blocks=64 + 24 * most))
        model = engine.runner.model
        backends = {"c_kernel": TorchAttentionBackend(), "torch_ops": TorchAttentionBackend(
            c_kernel=False)}
        for batch in args.batches:
            steps: dict[str, list[float]] = {name: [] for name in backends}
            for round_ in range(args.rounds):
                for name, backend in backends.items():
                    model.attention_backend = backend
                    steps[name] += decode_steps(engine, batch, seed=round_)
            row = {name: statistics.median(v) * 1e3 for name, v in steps.items()}
            row["speedup"] = row["torch_ops"] / row["c_kernel"]
            results.setdefault(f"{threads} thread(s)", {})[f"batch {batch}"] = row
            print(f"  batch {batch:>3}: step p50 C kernel {row['c_kernel']:6.2f} ms, torch ops "
                  f"{row['torch_ops']:6.2f} ms: {row['speedup']:.2f}x", flush=True)
        engine.close()
    print(f"load average {os.getloadavg()[0]:.2f}")
    print(f"saved {save_json('cpu_decode_attention', {'step_p50_ms': results})}")
    panels = [(f"{threads}: step p50 (ms)", "ms", {
        f"{b.split()[1]} {name[:1]}": row[name] for b, row in by_batch.items()
        for name in ("c_kernel", "torch_ops")}) for threads, by_batch in results.items()]
    title = "decode step: C kernel (c) vs torch ops (t), by batch"
    print(f"plot {bar_chart('cpu_decode_attention', panels, title, fmt='%.1f')}")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
