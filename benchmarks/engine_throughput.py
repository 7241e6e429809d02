"""Offline throughput: pdserve's continuous-batching engine vs transformers' static-batch generate.

Same checkpoint, workload, process and thread count; greedy, EOS ignored; tokens must agree.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from _common import (  # run as a script: python benchmarks/engine_throughput.py
    DEFAULT_MODEL_DIR,
    Progress,
    bar_chart,
    ensure_checkpoint,
    offline,
    save_json,
    set_threads,
)

NUM_SPECIAL_TOKENS = 3  # ids 0..2 are the generator's special tokens; prompts avoid them
PARITY_SHOWN = 3  # mismatching requests printed in full
# Warm-up prompt: not a prefix of any workload prompt, so the prefix cache gains nothing.
WARMUP_PROMPT = list(range(NUM_SPECIAL_TOKENS, NUM_SPECIAL_TOKENS + 32))


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_len: int


@dataclass(frozen=True)
class PdserveResult:
    seconds: float
    output_tokens: int
    prefill_steps: int
    prefill_prompt_tokens: int
    prefill_decode_rows: int  # decode rows that rode along in steps carrying prompt tokens
    prefill_seconds: float
    decode_steps: int
    decode_tokens: int
    decode_seconds: float


@dataclass(frozen=True)
class HFResult:
    seconds: float
    output_tokens: int
    padded_prompt_tokens: int


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--min-prompt-len", type=int, default=64)
    p.add_argument("--max-prompt-len", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2, help="torch threads for both engines")
    p.add_argument("--batch-size", type=int, default=8, help="transformers' static batch size")
    p.add_argument("--seed", type=int, default=0, help="workload RNG seed")
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    p.add_argument("--size", default="small", choices=("tiny", "small"))
    p.add_argument("--quick", action="store_true", help="tiny-model smoke run (< 1 min)")
    args = p.parse_args()
    if args.quick:
        args.size, args.num_requests, args.output_len = "tiny", 8, 16
        args.min_prompt_len, args.max_prompt_len, args.batch_size = 16, 128, 4
    return args


def make_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    rng = random.Random(args.seed)
    lengths = [
        rng.randint(args.min_prompt_len, args.max_prompt_len) for _ in range(args.num_requests)
    ]
    prompts = [[rng.randrange(NUM_SPECIAL_TOKENS, vocab_size) for _ in range(n)] for n in lengths]
    return Workload(prompts, args.output_len)


def run_pdserve(path: Path, workload: Workload) -> tuple[PdserveResult, list[list[int]]]:
    """Add every request, then step until all finish; classify each step by what it carried.

    A step whose computed tokens equal the tokens it returned is decode-only; any other step
    carries prompt tokens (its decode rows are the outputs past each request's first token).
    """
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.engine_config import EngineConfig
    from pdserve.engine.sampling_params import SamplingParams

    longest = max(map(len, workload.prompts)) + workload.output_len
    engine = LLMEngine(
        EngineConfig(model_path=str(path), dtype="float32", device="cpu", max_model_len=longest)
    )
    params = SamplingParams(max_tokens=workload.output_len, temperature=0.0, ignore_eos=True)
    engine.generate([WARMUP_PROMPT], SamplingParams(max_tokens=4, temperature=0.0))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(workload.prompts))}
    for rid, prompt in zip(tokens, workload.prompts, strict=True):
        engine.add_request(rid, prompt, params)
    counts = dict.fromkeys(("p_steps", "p_tokens", "p_rows", "d_steps", "d_tokens"), 0)
    p_seconds = d_seconds = 0.0
    progress = Progress("pdserve")
    started = time.perf_counter()
    num_done = 0
    while engine.has_unfinished_requests():
        computed_before = engine.stats.num_tokens_computed
        t0 = time.perf_counter()
        outputs = engine.step()
        dt = time.perf_counter() - t0
        computed = engine.stats.num_tokens_computed - computed_before
        for out in outputs:
            tokens[out.request_id].extend(out.new_token_ids)
            num_done += out.finished
        if computed == len(outputs):
            counts["d_steps"] += 1
            counts["d_tokens"] += computed
            d_seconds += dt
        else:
            rows = sum(1 for out in outputs if out.num_output_tokens > 1)
            counts["p_steps"] += 1
            counts["p_tokens"] += computed - rows
            counts["p_rows"] += rows
            p_seconds += dt
        progress.update(
            f"step {engine.stats.num_steps}: {len(outputs)} seqs, {computed} tokens "
            f"this step; {num_done}/{len(tokens)} requests done"
        )
    seconds = time.perf_counter() - started
    progress.update(f"all {len(tokens)} requests done", force=True)
    result = PdserveResult(
        seconds=seconds,
        output_tokens=sum(map(len, tokens.values())),
        prefill_steps=counts["p_steps"],
        prefill_prompt_tokens=counts["p_tokens"],
        prefill_decode_rows=counts["p_rows"],
        prefill_seconds=p_seconds,
        decode_steps=counts["d_steps"],
        decode_tokens=counts["d_tokens"],
        decode_seconds=d_seconds,
    )
    return result, list(tokens.values())


def run_transformers(
    path: Path, workload: Workload, batch_size: int
) -> tuple[HFResult, list[list[int]]]:
    """Static batches in arrival order, left-padded with an attention mask."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    pad_id = model.generation_config.pad_token_id or 0
    gen_args = {
        "max_new_tokens": workload.output_len,
        "min_new_tokens": workload.output_len,
        "do_sample": False,
        "pad_token_id": pad_id,
    }
    warm = torch.tensor([WARMUP_PROMPT])
    with torch.inference_mode():
        model.generate(
            warm,
            attention_mask=torch.ones_like(warm),
            **{**gen_args, "max_new_tokens": 4, "min_new_tokens": 4},
        )
    outputs: list[list[int]] = []
    padded_tokens = 0
    progress = Progress("transformers")
    started = time.perf_counter()
    for first in range(0, len(workload.prompts), batch_size):
        batch = workload.prompts[first : first + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, **gen_args)
        outputs.extend(out[:, width:].tolist())
        padded_tokens += ids.numel()
        progress.update(
            f"batch {first // batch_size + 1}: {len(batch)} prompts padded to {width}; "
            f"{len(outputs)}/{len(workload.prompts)} requests done",
            force=True,
        )
    seconds = time.perf_counter() - started
    return HFResult(seconds, sum(map(len, outputs)), padded_tokens), outputs


def check_parity(ours: list[list[int]], theirs: list[list[int]]) -> int:
    """Print how many requests match token for token, and the first mismatches in detail."""
    matches = 0
    shown = 0
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a == b:
            matches += 1
            continue
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if shown < PARITY_SHOWN:
            shown += 1
            print(
                f"  MISMATCH request {i}: first differing output token {first} "
                f"(pdserve {a[first : first + 4]} vs transformers {b[first : first + 4]})"
            )
    print(
        f"greedy parity: {matches}/{len(ours)} requests token-identical "
        f"({'OK' if matches == len(ours) else 'MISMATCH - this is a bug to report'})"
    )
    return matches


def report(
    args: argparse.Namespace,
    pd: PdserveResult,
    hf: HFResult,
    matches: int,
    workload: Workload,
    machine: str,
) -> None:
    pd_tps, hf_tps = pd.output_tokens / pd.seconds, hf.output_tokens / hf.seconds
    prefill_tps = pd.prefill_prompt_tokens / max(pd.prefill_seconds, 1e-9)
    decode_tps = pd.decode_tokens / max(pd.decode_seconds, 1e-9)
    prompt_tokens = sum(map(len, workload.prompts))
    print("\n=== engine throughput ===")
    print(machine)
    print(
        f"workload: {len(workload.prompts)} requests, {prompt_tokens} prompt tokens "
        f"(lengths {args.min_prompt_len}-{args.max_prompt_len}, seed {args.seed}), "
        f"{workload.output_len} output tokens each, greedy, EOS ignored; {args.size} llama"
    )
    print(
        f"pdserve      (continuous batching)      {pd_tps:8.1f} output tokens/s "
        f"({pd.output_tokens} tokens in {pd.seconds:.1f} s)"
    )
    print(
        f"transformers (static batches of {args.batch_size:<3d})   {hf_tps:8.1f} output tokens/s "
        f"({hf.output_tokens} tokens in {hf.seconds:.1f} s; {hf.padded_prompt_tokens} padded prompt tokens)"
    )
    print(f"ratio pdserve / transformers: {pd_tps / hf_tps:.2f}x (target >= 1.5x)")
    print(
        f"pdserve prefill: {prefill_tps:8.1f} prompt tokens/s ({pd.prefill_prompt_tokens} tokens in "
        f"{pd.prefill_steps} steps, {pd.prefill_seconds:.1f} s)"
    )
    print(
        f"pdserve decode:  {decode_tps:8.1f} tokens/s ({pd.decode_tokens} tokens in "
        f"{pd.decode_steps} decode-only steps, {pd.decode_seconds:.1f} s)"
    )
    print(
        "  method: each engine step is timed; a step is decode-only when every row it computed "
        "sampled a token,\n  else it carried prompt tokens. Prefill rate = prompt tokens / time of "
        f"those steps (it includes\n  the {pd.prefill_decode_rows} decode rows that rode along in "
        "them); decode rate = tokens / time of decode-only steps."
    )
    print(f"greedy parity: {matches}/{len(workload.prompts)} requests identical")
    name = "engine_throughput_quick" if args.quick else "engine_throughput"
    results = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": machine,
        "pdserve": asdict(pd),
        "transformers": asdict(hf),
        "pdserve_output_tokens_per_s": pd_tps,
        "transformers_output_tokens_per_s": hf_tps,
        "ratio": pd_tps / hf_tps,
        "pdserve_prefill_tokens_per_s": prefill_tps,
        "pdserve_decode_tokens_per_s": decode_tps,
        "parity_matches": matches,
    }
    json_path = save_json(name, results)
    png_path = bar_chart(
        name,
        [
            ("output tokens/s", "tokens/s", {"pdserve": pd_tps, "transformers": hf_tps}),
            ("pdserve phases", "tokens/s", {"prefill": prefill_tps, "decode": decode_tps}),
        ],
        f"{args.size} llama, {len(workload.prompts)} requests, {args.threads} threads: "
        f"{pd_tps / hf_tps:.2f}x",
    )
    print(f"saved {json_path} and {png_path}")


def main() -> None:
    args = parse_args()
    offline()
    started = time.perf_counter()
    machine = set_threads(args.threads)
    path = ensure_checkpoint(args.model_dir, "llama", args.size)
    from transformers import AutoConfig

    workload = make_workload(args, AutoConfig.from_pretrained(str(path)).vocab_size)
    print(f"pdserve: {len(workload.prompts)} requests, continuous batching ...", flush=True)
    pd, ours = run_pdserve(path, workload)
    print(f"transformers: static batches of {args.batch_size} ...", flush=True)
    hf, theirs = run_transformers(path, workload, args.batch_size)
    matches = check_parity(ours, theirs)
    report(args, pd, hf, matches, workload, machine)
    print(f"total benchmark time {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
