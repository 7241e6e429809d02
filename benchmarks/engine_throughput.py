"""Offline throughput: pdserve's continuous-batching engine vs transformers' static-batch generate.

Same checkpoint, workload, process and thread count; greedy, EOS ignored; float32 tokens agree.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _common import (  # run as a script: python benchmarks/engine_throughput.py
    DEFAULT_MODEL_DIR,
    Progress,
    ensure_checkpoint,
    offline,
    set_threads,
)
from _throughput_report import (
    Comparison,
    PhaseTally,
    Run,
    Stopwatch,
    print_report,
    save_report,
)

from pdserve.cluster.config import engine_config
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams

NUM_SPECIAL_TOKENS = 3  # ids 0..2 are the generator's special tokens; prompts avoid them
PARITY_SHOWN = 3  # mismatching requests printed in full
# Warm-up prompt: not a prefix of any workload prompt, so the prefix cache gains nothing.
WARMUP_PROMPT = list(range(NUM_SPECIAL_TOKENS, NUM_SPECIAL_TOKENS + 32))


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_len: int


# Named workloads; any flag given on the command line overrides its preset's value.
# spread: prompts of many lengths, where continuous batching and the grouped decode attention
# pay; decode: 32 equal short prompts and long outputs in bfloat16, a decode-bound batch.
WORKLOADS: dict[str, dict[str, Any]] = {
    "spread": {"size": "small", "dtype": "float32", "num_requests": 32, "output_len": 128,
               "min_prompt_len": 64, "max_prompt_len": 1024, "batch_size": 8},
    "decode": {"size": "medium", "dtype": "bfloat16", "num_requests": 32, "output_len": 128,
               "min_prompt_len": 40, "max_prompt_len": 40, "batch_size": 32},
    "quick": {"size": "tiny", "dtype": "float32", "num_requests": 8, "output_len": 16,
              "min_prompt_len": 16, "max_prompt_len": 128, "batch_size": 4},
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="spread",
                   help="named preset (default spread); the flags below override its values")
    p.add_argument("--num-requests", type=int)
    p.add_argument("--output-len", type=int)
    p.add_argument("--min-prompt-len", type=int)
    p.add_argument("--max-prompt-len", type=int)
    p.add_argument("--threads", type=int, default=2, help="torch threads for both engines")
    p.add_argument("--batch-size", type=int, help="transformers' static batch size")
    p.add_argument("--seed", type=int, default=0, help="workload RNG seed")
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    p.add_argument("--size", choices=("tiny", "medium", "small"))
    p.add_argument("--dtype", choices=("float32", "bfloat16"))
    p.add_argument("--quick", action="store_true", help="tiny-model smoke run (< 1 min)")
    args = p.parse_args()
    if args.quick:
        args.workload = "quick"
    for name, value in WORKLOADS[args.workload].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def make_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    rng = random.Random(args.seed)
    lengths = [
        rng.randint(args.min_prompt_len, args.max_prompt_len) for _ in range(args.num_requests)
    ]
    prompts = [[rng.randrange(NUM_SPECIAL_TOKENS, vocab_size) for _ in range(n)] for n in lengths]
    return Workload(prompts, args.output_len)


def run_pdserve(
    path: Path, workload: Workload, dtype: str
) -> tuple[Run, PhaseTally, list[list[int]]]:
    """Add every request, then step until all finish, timing each step (see PhaseTally)."""
    longest = max(map(len, workload.prompts)) + workload.output_len
    engine = LLMEngine(
        engine_config(str(path), dtype=dtype, device="cpu", max_model_len=longest)
    )
    params = SamplingParams(max_tokens=workload.output_len, temperature=0.0, ignore_eos=True)
    engine.generate([WARMUP_PROMPT], SamplingParams(max_tokens=4, temperature=0.0))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(workload.prompts))}
    for rid, prompt in zip(tokens, workload.prompts, strict=True):
        engine.add_request(rid, prompt, params)
    tally, progress, watch = PhaseTally(len(tokens)), Progress("pdserve"), Stopwatch()
    num_done = 0
    while engine.has_unfinished_requests():
        computed_before, step_started = engine.stats.num_tokens_computed, time.perf_counter()
        outputs = engine.step()
        step_seconds = time.perf_counter() - step_started
        computed = engine.stats.num_tokens_computed - computed_before
        tally.add(computed, outputs, step_seconds)
        for out in outputs:
            tokens[out.request_id].extend(out.new_token_ids)
            num_done += out.finished
        progress.update(
            f"step {engine.stats.num_steps}: {len(outputs)} seqs, {computed} tokens "
            f"this step; {num_done}/{len(tokens)} requests done"
        )
    run = watch.stop(sum(map(len, tokens.values())))
    progress.update(f"all {len(tokens)} requests done", force=True)
    return run, tally, list(tokens.values())


def run_transformers(
    path: Path, workload: Workload, batch_size: int, dtype: str
) -> tuple[Run, list[list[int]]]:
    """Static batches in arrival order, left-padded with an attention mask."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).eval()
    pad_id = model.generation_config.pad_token_id or 0

    def generate(ids: torch.Tensor, mask: torch.Tensor, num_new: int) -> torch.Tensor:
        with torch.inference_mode():
            return model.generate(  # type: ignore[no-any-return]
                ids,
                attention_mask=mask,
                max_new_tokens=num_new,
                min_new_tokens=num_new,
                do_sample=False,
                pad_token_id=pad_id,
            )

    warm = torch.tensor([WARMUP_PROMPT])
    generate(warm, torch.ones_like(warm), 4)
    outputs: list[list[int]] = []
    padded_tokens = 0
    progress, watch = Progress("transformers"), Stopwatch()
    for first in range(0, len(workload.prompts), batch_size):
        batch = workload.prompts[first : first + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        outputs.extend(generate(ids, mask, workload.output_len)[:, width:].tolist())
        padded_tokens += ids.numel()
        progress.update(
            f"batch {first // batch_size + 1}: {len(batch)} prompts padded to {width}; "
            f"{len(outputs)}/{len(workload.prompts)} requests done",
            force=True,
        )
    return watch.stop(sum(map(len, outputs)), padded_tokens), outputs


def check_parity(ours: list[list[int]], theirs: list[list[int]]) -> int:
    """Count requests that match token for token; print the first mismatches in detail."""
    mismatched = [i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b]
    for i in mismatched[:PARITY_SHOWN]:
        a, b = ours[i], theirs[i]
        first = next(
            (j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )
        print(
            f"  MISMATCH request {i}: first differing output token {first} "
            f"(pdserve {a[first : first + 4]} vs transformers {b[first : first + 4]})"
        )
    return len(ours) - len(mismatched)


def main() -> None:
    args = parse_args()
    offline()
    started = time.perf_counter()
    machine = set_threads(args.threads)
    path = ensure_checkpoint(args.model_dir, "llama", args.size, dtype=args.dtype)
    from transformers import AutoConfig

    workload = make_workload(args, AutoConfig.from_pretrained(str(path)).vocab_size)
    print(f"pdserve: {len(workload.prompts)} requests, continuous batching ...", flush=True)
    pd, tally, ours = run_pdserve(path, workload, args.dtype)
    print(f"transformers: static batches of {args.batch_size} ...", flush=True)
    hf, theirs = run_transformers(path, workload, args.batch_size, args.dtype)
    result = Comparison(pd, tally, hf, check_parity(ours, theirs), len(workload.prompts))
    print(f"\n=== engine throughput ===\n{machine}")
    print_report(args, sum(map(len, workload.prompts)), result)
    save_report(args, machine, result)
    print(f"total benchmark time {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
