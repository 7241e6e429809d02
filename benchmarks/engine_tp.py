"""Tensor parallelism on CPU: one engine's prefill and decode rates at TP=2 (two rank processes
over gloo, one torch thread each) against TP=1 with one thread and with two.

Rank 0 runs the engine and times it; rank 1 runs `ShardEngine`, following rank 0's step plans.
Prefill: every prompt in, one output token each. Decode: short prompts, then only the steps
that compute one token per sequence are counted. Rates are the best of ``--repeats`` runs (new
prompts each); greedy tokens of the first run are compared with TP=1 on one thread.
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from pathlib import Path
from typing import Any

import torch
from _common import DEFAULT_MODEL_DIR, ensure_checkpoint, offline, set_threads

from pdserve.cluster.config import engine_config
from pdserve.engine.engine import LLMEngine
from pdserve.engine.parallel import SINGLE_RANK, TPGroup
from pdserve.engine.parallel.group import connect_group, host_store
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.shard_engine import run_shard

COLLECTIVE_TIMEOUT_S = 120.0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--size", choices=("tiny", "small"), default="small")
    p.add_argument("--num-seqs", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256, help="prefill phase prompt length")
    p.add_argument("--decode-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=2, help="runs per setting (best kept)")
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    return p.parse_args()


def _prompts(count: int, length: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (count, length), generator=generator).tolist()


def _drive(engine: LLMEngine, prompts: list[list[int]], max_tokens: int,
           decode_only: bool) -> tuple[float, int, list[list[int]]]:
    """Step until done; seconds and tokens of the counted steps, and every output."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"r{engine.stats.num_steps}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    seconds, counted = 0.0, 0
    while engine.has_unfinished_requests():
        before, started = engine.stats.num_tokens_computed, time.perf_counter()
        outputs = engine.step()
        took, computed = time.perf_counter() - started, engine.stats.num_tokens_computed - before
        for out in outputs:
            tokens[out.request_id].extend(out.new_token_ids)
        if not decode_only or computed == len(outputs):
            seconds, counted = seconds + took, counted + computed
    return seconds, counted, list(tokens.values())


def measure(path: str, tp: TPGroup, args: argparse.Namespace) -> dict[str, Any] | int:
    config = engine_config(path, dtype="float32", device="cpu",
                           max_model_len=args.prompt_len + args.decode_tokens + 16)
    if not tp.is_first:
        return run_shard(config, tp)
    engine = LLMEngine(config, tp=tp)
    try:
        _drive(engine, _prompts(2, 32, 0), 4, False)  # warm-up
        best: dict[str, Any] = {}
        tokens: list[list[int]] = []
        for repeat in range(args.repeats):
            p_s, p_tok, p_out = _drive(engine, _prompts(args.num_seqs, args.prompt_len,
                                                         1 + repeat), 1, False)
            d_s, d_tok, d_out = _drive(engine, _prompts(args.num_seqs, 8, 100 + repeat),
                                       args.decode_tokens, True)
            run = {"prefill_tok_s": p_tok / p_s, "decode_tok_s": d_tok / d_s,
                   "decode_step_ms": 1000 * d_s / (d_tok / args.num_seqs)}
            if repeat == 0:  # the same prompts in every setting: the tokens to compare
                tokens = p_out + d_out
            if not best or run["decode_tok_s"] > best["decode_tok_s"]:
                best = run
        return {**best, "tokens": tokens}
    finally:
        engine.stop_ranks()


def _rank_main(rendezvous: Any, rank: int, path: str, args: argparse.Namespace,
               results: Any) -> None:
    torch.set_num_threads(1)
    group = connect_group(rendezvous, rank, torch.device("cpu"), COLLECTIVE_TIMEOUT_S)
    try:
        results.put((rank, measure(path, group, args)))
    finally:
        group.close()


def run_tp2(path: str, args: argparse.Namespace) -> dict[str, Any]:
    """Two rank processes (spawned), one thread each; rank 0's numbers."""
    rendezvous, store = host_store("127.0.0.1", 2, COLLECTIVE_TIMEOUT_S)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    ranks = [ctx.Process(target=_rank_main, args=(rendezvous, r, path, args, results))
             for r in range(2)]
    for process in ranks:
        process.start()
    got = dict(results.get(timeout=1800) for _ in ranks)
    for process in ranks:
        process.join(60)
    del store
    return got[0]


def main() -> None:
    args = parse_args()
    offline()
    path = str(ensure_checkpoint(args.model_dir, "llama", args.size))
    rows = {}
    for threads in (1, 2):
        print(set_threads(threads), flush=True)
        rows[f"TP=1, {threads} thread(s)"] = measure(path, SINGLE_RANK, args)
    rows["TP=2, 1 thread per rank (gloo)"] = run_tp2(path, args)
    reference = rows["TP=1, 1 thread(s)"]["tokens"]
    print(f"\nllama-{args.size} float32, {args.num_seqs} sequences: prefill {args.prompt_len} "
          f"tokens each, decode {args.decode_tokens} tokens each; best of {args.repeats}")
    print(f"{'setting':34} {'prefill tok/s':>14} {'decode tok/s':>13} {'decode step ms':>15} "
          "  greedy tokens vs TP=1, 1 thread")
    for name, row in rows.items():
        print(f"{name:34} {row['prefill_tok_s']:14.1f} {row['decode_tok_s']:13.1f} "
              f"{row['decode_step_ms']:15.1f}   {_parity(row['tokens'], reference)}")


def _parity(tokens: list[list[int]], reference: list[list[int]]) -> str:
    """How many sequences equal the reference, and where the others first differ."""
    firsts = [next(i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b)
              for x, y in zip(tokens, reference, strict=True) if x != y]
    line = f"{len(tokens) - len(firsts)}/{len(tokens)} sequences equal"
    return line + (f"; others first differ at output token {sorted(firsts)}" if firsts else "")


if __name__ == "__main__":
    main()
