"""What constrained decoding costs in one engine: TPOT p50 at 32 streams with a JSON schema and
without, the unconstrained rows of a half-constrained batch, mask cost per step, compile time.

Rounds alternate the batches (free, schema, mixed, then free again as a control: two identical
batches differ by the noise alone) so that drift in the machine's load falls on all of them
alike; each figure is the median over rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from _common import (  # run as a script: python benchmarks/structured_outputs.py
    DEFAULT_MODEL_DIR,
    ensure_checkpoint,
    offline,
    save_json,
    set_threads,
)

from pdserve.cluster.config import engine_config
from pdserve.engine.engine import LLMEngine
from pdserve.engine.grammar import GrammarCompiler
from pdserve.engine.grammar_masks import StepMask
from pdserve.engine.grammar_spec import GrammarSpec
from pdserve.engine.sampling_params import SamplingParams

# A typical API schema: nested objects, an enum, bounded numbers, a short array. The answer
# must list at least 200 of them, so it never ends before max_tokens and every measured step
# carries its mask.
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]},
    "address": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["city", "zip"], "additionalProperties": False},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "active": {"type": "boolean"}},
    "required": ["name", "age", "role", "address", "tags", "active"],
    "additionalProperties": False}
LONG_ANSWER = {"type": "object", "properties": {"people": {
    "type": "array", "items": PERSON, "minItems": 200}},
    "required": ["people"], "additionalProperties": False}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: the engine thread's CPU time covers all compute)")
    p.add_argument("--size", default="tiny", choices=("tiny", "medium", "small"))
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    p.add_argument("--masks", choices=("engine", "thread"), default=None,
                   help="where masks are filled: on the engine thread after the forward pass "
                   "or on the masks' thread during it (default: the engine's choice for its "
                   "device, engine on CPU)")
    return p.parse_args()


def tpot_by_request(engine: LLMEngine, prompt: list[int], params: list[SamplingParams],
                    clock: Callable[[], float]) -> dict[int, float]:
    """Each request's seconds per output token after its first, all run as one batch, on
    ``clock``: wall time, or the process's CPU time (what other processes on a shared machine
    distort least, with one torch thread; it counts the mask thread's work, which wall time
    hides behind the forward pass)."""
    batch = time.monotonic_ns()
    index = {f"r{i}-{batch}": i for i in range(len(params))}
    times: dict[int, list[float]] = {i: [] for i in index.values()}
    for rid, i in index.items():
        engine.add_request(rid, prompt, params[i])
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = clock()
        for out in outputs:
            times[index[out.request_id]] += [now] * len(out.new_token_ids)
    return {i: (t[-1] - t[1]) / (len(t) - 2) for i, t in times.items() if len(t) > 2}


def measure(engine: LLMEngine, prompt: list[int],
            params: Callable[[set[int]], list[SamplingParams]], batches: dict[str, set[int]],
            num_rounds: int, clock: Callable[[], float]) -> dict[str, float]:
    """TPOT p50 (ms) of each batch's requests, the mixed batch's free and constrained rows
    apart: each round's median, then the median over rounds and (``*_best``) the lowest, the
    round other processes disturbed least."""
    rounds: dict[str, list[float]] = {name: [] for name in ("free", "schema", "mixed_free",
                                                           "mixed_schema", "free_again")}
    for _ in range(num_rounds):
        for name, constrained in batches.items():
            tpots = tpot_by_request(engine, prompt, params(constrained), clock)
            if name == "mixed":
                rounds["mixed_free"].append(statistics.median(
                    v for i, v in tpots.items() if i not in constrained))
                rounds["mixed_schema"].append(statistics.median(
                    v for i, v in tpots.items() if i in constrained))
            else:
                rounds[name].append(statistics.median(tpots.values()))
    return ({name: statistics.median(v) * 1000.0 for name, v in rounds.items()}
            | {f"{name}_best": min(v) * 1000.0 for name, v in rounds.items()})


def timed_masks(engine: LLMEngine) -> dict[str, dict[int, list[float]]]:
    """Wrap the runner's mask fill (wall seconds: it may run on the masks' thread) and the
    sampler's mask apply (CPU seconds, engine thread) to record their time per step, by rows
    masked."""
    seconds: dict[str, dict[int, list[float]]] = {"fill": {}, "apply": {}}
    masks = engine.runner.grammars
    assert masks is not None
    fill, apply = masks.fill, StepMask.apply

    def timed_fill(requests):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        mask = fill(requests)
        if mask is not None:
            seconds["fill"].setdefault(len(mask.rows), []).append(time.perf_counter() - start)
        return mask

    def timed_apply(self, logits):  # type: ignore[no-untyped-def]
        start = time.thread_time()
        apply(self, logits)
        seconds["apply"].setdefault(len(self.rows), []).append(time.thread_time() - start)

    masks.fill = timed_fill  # type: ignore[method-assign]
    StepMask.apply = timed_apply  # type: ignore[method-assign]
    return seconds


def compile_times(engine: LLMEngine) -> dict[str, float]:
    """A fresh compiler's vocabulary set-up (done on its thread as it starts), its first
    compile of the typical schema and a cached repeat, in ms."""
    tokenizer = engine.tokenizer
    start = time.perf_counter()
    fresh = GrammarCompiler(engine.grammars.vocab_size, engine.grammars._vocabulary,  # noqa: SLF001
                            tokenizer.eos_token_ids)
    fresh._pool.submit(lambda: None).result()  # noqa: SLF001 - queued behind the set-up
    out = {"vocabulary_ms": (time.perf_counter() - start) * 1000.0}
    for name in ("first_ms", "cached_ms"):
        start = time.perf_counter()
        fresh.get(GrammarSpec.json_schema(PERSON))
        out[name] = (time.perf_counter() - start) * 1000.0
    fresh.close()
    return out


def ratios(tpot_ms: dict[str, dict[str, float]], name: str) -> dict[str, float]:
    """``name``'s TPOT over the free batch's, per clock, as medians and as best rounds."""
    out = {}
    for clock, t in tpot_ms.items():
        out[clock] = t[name] / t["free"]
        out[f"{clock}_best"] = t[f"{name}_best"] / t["free_best"]
    return out


def main() -> None:
    args = parse_args()
    offline()
    print(set_threads(args.threads))
    path = ensure_checkpoint(args.model_dir, "llama", args.size)
    engine = LLMEngine(engine_config(str(path), num_kv_blocks=64 + 8 * args.streams,
                                     max_num_seqs=args.streams))
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "List people as JSON."}])
    spec = GrammarSpec.json_schema(LONG_ANSWER)
    mask_seconds = timed_masks(engine)
    assert engine.runner.grammars is not None
    if args.masks is not None:
        engine.runner.grammars.overlap = args.masks == "thread"
    masks_on = "thread" if engine.runner.grammars.overlap else "engine"
    n = args.streams

    def params(constrained: set[int]) -> list[SamplingParams]:
        return [SamplingParams(max_tokens=args.output_tokens, seed=i, ignore_eos=i not in
                               constrained, grammar=spec if i in constrained else None)
                for i in range(n)]

    batches = {"free": set(), "schema": set(range(n)), "mixed": set(range(0, n, 2)),
               "free_again": set()}
    tpot_by_request(engine, prompt, params(batches["schema"])[:2], time.perf_counter)  # warm up
    tpot_ms = {clock: measure(engine, prompt, params, batches, args.rounds, fn)
               for clock, fn in (("wall", time.perf_counter), ("cpu", time.process_time))}
    results = {
        "size": args.size, "streams": n, "output_tokens": args.output_tokens,
        "rounds": args.rounds, "threads": args.threads, "masks_filled_on": masks_on,
        "load_average": os.getloadavg()[0], "tpot_p50_ms": tpot_ms,
        "schema_over_free": ratios(tpot_ms, "schema"),
        "mixed_free_over_free": ratios(tpot_ms, "mixed_free"),
        "free_again_over_free": ratios(tpot_ms, "free_again"),
        "mask_cpu_ms_p50": {part: {rows: statistics.median(v) * 1000.0
                                   for rows, v in sorted(by_rows.items()) if len(v) >= 10}
                            for part, by_rows in mask_seconds.items()},
        "compile": compile_times(engine),
        "grammar_stats": vars(engine.grammars.stats),
    }
    for clock, tpots in tpot_ms.items():
        print(f"TPOT p50 ({clock} time; median of rounds / best round): " + ", ".join(
            f"{k} {v:.2f}/{tpots[k + '_best']:.2f} ms" for k, v in tpots.items()
            if not k.endswith("_best")))
        print(f"  schema / free: {results['schema_over_free'][clock]:.3f} "
              f"(best rounds {results['schema_over_free'][clock + '_best']:.3f})   mixed "
              f"batch's free rows / free: {results['mixed_free_over_free'][clock]:.3f} "
              f"(best rounds {results['mixed_free_over_free'][clock + '_best']:.3f})   "
              f"control, free again / free: {results['free_again_over_free'][clock]:.3f} "
              f"(best rounds {results['free_again_over_free'][clock + '_best']:.3f})")
    for part, by_rows in results["mask_cpu_ms_p50"].items():
        print(f"mask {part} per step (median): " + ", ".join(
            f"{rows} rows {ms:.3f} ms" for rows, ms in by_rows.items()))
    print("compile: " + ", ".join(f"{k} {v:.2f}" for k, v in results["compile"].items()))
    name = f"structured_outputs_{args.size}_{masks_on}"
    print(f"saved {save_json(name, results)}")
    engine.close()


if __name__ == "__main__":
    main()
