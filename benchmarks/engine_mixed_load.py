"""Short prompts among long ones in one engine: short TTFT, long TTFT and short TPOT.

Arrivals replayed in wall-clock time against one LLMEngine, as a prefill worker or colocated.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from _common import (  # run as a script: python benchmarks/engine_mixed_load.py
    DEFAULT_MODEL_DIR,
    bar_chart,
    ensure_checkpoint,
    offline,
    percentile,
    save_json,
    set_threads,
)

from pdserve.cluster.config import engine_config
from pdserve.engine.engine import LLMEngine
from pdserve.engine.loaded_model import LoadedModel
from pdserve.engine.request import RequestMode
from pdserve.engine.sampling_params import SamplingParams

NUM_SPECIAL_TOKENS = 3  # ids 0..2 are the generator's special tokens; prompts avoid them


@dataclass(frozen=True)
class Arrival:
    at_s: float
    request_id: str
    prompt: list[int]
    max_tokens: int

    @property
    def is_long(self) -> bool:
        return self.request_id.startswith("long")


@dataclass
class Timings:
    arrived_at: float
    token_times: list[float] = field(default_factory=list)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--duration-s", type=float, default=8.0, help="arrivals span this long")
    p.add_argument("--long-len", type=int, default=3000, help="tokens of a long prompt")
    p.add_argument("--long-rate", type=float, default=0.5, help="long prompts per second")
    p.add_argument("--short-len", type=int, default=40, help="tokens of a short prompt")
    p.add_argument("--short-rate", type=float, default=4.0, help="short prompts per second")
    p.add_argument("--short-output", type=int, default=32, help="tokens a short one generates")
    p.add_argument("--budget", type=int, default=1024, help="max_num_batched_tokens")
    p.add_argument("--caps", default="512,256,128",
                   help="long_prefill_token_threshold values to compare with no cap")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size", default="medium", choices=("tiny", "medium", "small"))
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    p.add_argument("--quick", action="store_true", help="tiny model, 3 s of arrivals")
    args = p.parse_args()
    if args.quick:
        args.size, args.dtype, args.duration_s, args.long_len = "tiny", "float32", 3.0, 1500
    return args


def make_arrivals(args: argparse.Namespace, vocab_size: int) -> list[Arrival]:
    rng = random.Random(args.seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(NUM_SPECIAL_TOKENS, vocab_size) for _ in range(n)]

    arrivals = [Arrival(i / args.long_rate, f"long{i}", prompt(args.long_len), 8)
                for i in range(int(args.duration_s * args.long_rate))]
    at = rng.expovariate(args.short_rate)
    while at < args.duration_s:
        arrivals.append(Arrival(at, f"short{len(arrivals)}", prompt(args.short_len),
                                args.short_output))
        at += rng.expovariate(args.short_rate)
    return sorted(arrivals, key=lambda a: a.at_s)


def replay(engine: LLMEngine, arrivals: list[Arrival], mode: RequestMode) -> dict[str, Timings]:
    """Add each request when its time comes, step while there is work; stamp every token.

    A prefill worker's request ends at its first token: its blocks are released at once.
    """
    pending, timings = list(reversed(arrivals)), {}
    started = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - started
        while pending and pending[-1].at_s <= now:
            a = pending.pop()
            params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(a.request_id, a.prompt, params, mode)
            timings[a.request_id] = Timings(a.at_s)
        if not engine.has_schedulable_requests():
            time.sleep(max(0.0, pending[-1].at_s - now) if pending else 0.0)
            continue
        for out in engine.step():
            timings[out.request_id].token_times.append(time.perf_counter() - started)
            if out.finish_reason == "prefilled":
                engine.release(out.request_id)
    return timings


def summarize(arrivals: list[Arrival], timings: dict[str, Timings]) -> dict[str, float]:
    def ttfts(long: bool) -> list[float]:
        return [1000 * (timings[a.request_id].token_times[0] - a.at_s)
                for a in arrivals if a.is_long == long]

    gaps = [1000 * (b - a) for arr in arrivals if not arr.is_long
            for a, b in zip(timings[arr.request_id].token_times,
                            timings[arr.request_id].token_times[1:], strict=False)]
    short, long = ttfts(False), ttfts(True)
    return {
        "short_ttft_p50_ms": percentile(short, 50), "short_ttft_p90_ms": percentile(short, 90),
        "short_ttft_p99_ms": percentile(short, 99), "long_ttft_p50_ms": percentile(long, 50),
        "short_tpot_p50_ms": percentile(gaps, 50), "short_tpot_p99_ms": percentile(gaps, 99),
    }


MODES = {"prefill": RequestMode.PREFILL_ONLY, "colocated": RequestMode.FULL}


def measure(args: argparse.Namespace, path: Path, cap: int) -> dict[str, dict[str, float]]:
    """Both modes with one chunk cap (0: none); with no cap, also the short prompts alone."""
    config = engine_config(
        str(path), dtype=args.dtype, device="cpu", num_kv_blocks=2048,
        max_num_batched_tokens=args.budget, max_num_seqs=64, long_prefill_token_threshold=cap)
    loaded = LoadedModel.load(config.model_path, config.resolve_dtype(config.resolve_device()),
                              config.resolve_device())
    arrivals = make_arrivals(args, loaded.config.vocab_size)
    shorts = [a for a in arrivals if not a.is_long]
    replay(LLMEngine(config, loaded), shorts[:4], RequestMode.FULL)  # warm-up
    results = {}
    for name, mode in MODES.items():
        label = f"{name}, cap {cap or 'none'}"
        print(f"replaying {len(arrivals)} arrivals: {label} ...", flush=True)
        engine = LLMEngine(config, loaded)  # each mode starts with an empty prefix cache
        results[label] = summarize(arrivals, replay(engine, arrivals, mode))
        if cap == 0:  # the same short prompts with no long ones: an idle server
            alone = replay(engine, shorts, mode)
            results[f"{name}, short prompts alone"] = summarize(shorts, alone)
    return results


def print_report(args: argparse.Namespace, machine: str, results: dict[str, dict[str, float]]
                 ) -> None:
    print(f"\n=== engine mixed load ===\n{machine}")
    print(f"{args.size} llama {args.dtype}; budget {args.budget} tokens/step; long prompts of "
          f"{args.long_len} tokens at {args.long_rate}/s, short ones of {args.short_len} at "
          f"{args.short_rate}/s ({args.short_output} output tokens colocated), "
          f"{args.duration_s:.0f} s")
    header = ("short TTFT p50", "p90", "p99", "long TTFT p50", "short TPOT p50", "p99")
    print(f"{'':<32}" + "".join(f"{h:>15}" for h in header) + "   (ms)")
    for label, row in results.items():
        print(f"{label:<32}" + "".join(f"{v:15.1f}" for v in row.values()))
    for name in MODES:
        idle = results[f"{name}, short prompts alone"]["short_ttft_p90_ms"]
        ratios = ", ".join(f"{label.split(', ')[1]} {row['short_ttft_p90_ms'] / idle:.1f}x"
                           for label, row in results.items()
                           if label.startswith(name) and ", cap " in label)
        print(f"{name}: short TTFT p90 / idle p90: {ratios}")


def main() -> None:
    args = parse_args()
    offline()
    machine = set_threads(args.threads)
    path = ensure_checkpoint(args.model_dir, "llama", args.size, dtype=args.dtype)
    results: dict[str, dict[str, float]] = {}
    for cap in [0, *(int(c) for c in args.caps.split(",") if int(c))]:
        results.update(measure(args, path, cap))
    print_report(args, machine, results)
    name = "engine_mixed_load_quick" if args.quick else "engine_mixed_load"
    json_path = save_json(name, {"args": {k: str(v) for k, v in vars(args).items()},
                                 "machine": machine, "results": results})
    loaded = {k: v for k, v in results.items() if "alone" not in k}
    png_path = bar_chart(name, [
        ("short TTFT p90", "ms", {k: v["short_ttft_p90_ms"] for k, v in results.items()}),
        ("long TTFT p50", "ms", {k: v["long_ttft_p50_ms"] for k, v in loaded.items()}),
        ("short TPOT p99", "ms", {k: v["short_tpot_p99_ms"] for k, v in loaded.items()
                                  if k.startswith("colocated")}),
    ], f"{args.size} llama, budget {args.budget}")
    print(f"saved {json_path} and {png_path}")


if __name__ == "__main__":
    main()
