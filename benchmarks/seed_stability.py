"""How often a seeded draw changes with the batch around it: n seeded choices of one prompt
started together, against the same choices arriving a step or two apart (one engine, CPU).

A draw is a function of (seed, output index), but the logits it inverts can differ in their
last float bits with the batch (padded decode groups, prefill chunks in the same step). Prints
the choices whose tokens differ from the started-together run, and whether each first
difference is a vocabulary neighbour (the draw on a token boundary) or not (a real defect).

    python benchmarks/seed_stability.py --trials 400
"""

from __future__ import annotations

import argparse
import random
import time

from _common import add_model_args, ensure_checkpoint, offline, save_json

from pdserve.cluster.config import engine_config
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams

# Ids within this of the drawn one count as a neighbour (tests/e2e/test_http_cluster.py).
NEIGHBOURS = 16


def staggered(engine: LLMEngine, ids: list[int], params: list[SamplingParams],
              rng: random.Random, tag: str) -> list[list[int]]:
    """The choices' tokens when each joins the batch with probability 1/2 per step."""
    tokens: dict[str, list[int]] = {}
    pending = list(range(len(params)))
    rng.shuffle(pending)
    while pending or engine.has_unfinished_requests():
        if pending and rng.random() < 0.5:
            i = pending.pop()
            tokens[f"{tag}-{i}"] = []
            engine.add_request(f"{tag}-{i}", ids, params[i])
        if engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id].extend(out.new_token_ids)
    return [tokens[f"{tag}-{i}"] for i in range(len(params))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=400)
    p.add_argument("--choices", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=12)
    add_model_args(p)
    args = p.parse_args()
    offline()
    path = ensure_checkpoint(args.model_dir, "llama", "tiny")
    together = LLMEngine(engine_config(str(path), num_kv_blocks=128))
    apart = LLMEngine(engine_config(str(path), num_kv_blocks=128))
    rng = random.Random(args.seed)
    differ, neighbours, started = 0, 0, time.perf_counter()
    for trial in range(args.trials):
        ids = together.tokenizer.encode(f"Request {trial}: " + "a careful answer, " * 40)
        params = [SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=7 + i,
                                 ignore_eos=True) for i in range(args.choices)]
        want = together.generate([ids] * args.choices, params)
        for got, ref in zip(staggered(apart, ids, params, rng, f"t{trial}"), want, strict=True):
            if got != ref:
                k = next(k for k, (a, b) in enumerate(zip(got, ref, strict=True)) if a != b)
                differ += 1
                neighbours += abs(got[k] - ref[k]) <= NEIGHBOURS
                print(f"trial {trial}: token {k} drawn {got[k]} for {ref[k]}", flush=True)
        if (trial + 1) % 50 == 0:
            print(f"{trial + 1}/{args.trials} trials, {differ} differ "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
    total = args.trials * args.choices
    print(f"staggered against together: {differ} of {total} choices differ "
          f"({args.max_tokens} tokens each); first differences within {NEIGHBOURS} ids "
          f"(a draw on a boundary): {neighbours} of {differ}")
    save_json("seed_stability", {"choices": total, "differ": differ, "neighbours": neighbours,
                                 "max_tokens": args.max_tokens})


if __name__ == "__main__":
    main()
