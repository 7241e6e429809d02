"""Load or recompute, measured: for prompt prefixes of growing length, the time to compute
them (a miss) against the time to load them back from each tier beside the device (the host
tier, the shared Mooncake store), on this machine, one engine thread.

Prints a table per length and the crossover (the shortest prefix whose load beats its
compute) per tier; saves JSON and a plot under benchmarks/results/.

    python benchmarks/kv_crossover.py [--size small] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS_DIR, ensure_checkpoint, offline, set_threads  # noqa: E402

LENGTHS = (16, 32, 64, 128, 256, 512, 1024, 2048)


def first_token_s(engine, rid: str, prompt: list[int]):  # noqa: ANN001, ANN201
    """Seconds from adding the request to its first token, and its reuse record."""
    from pdserve.engine.sampling_params import SamplingParams

    started = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0,
                                                   ignore_eos=True))
    reuse = None
    while engine.has_unfinished_requests():
        if not engine.scheduler.has_schedulable_requests:
            engine.tiers.wait_finished()
        for out in engine.step():
            reuse = reuse or out.kv_reuse
    return time.perf_counter() - started, reuse


def settle(engine) -> None:  # noqa: ANN001
    while engine.tiers.has_work or engine.kv_stats().tiers.num_store_pinned_blocks:
        engine.tiers.wait_finished(0.05)
        engine.step()


def measure(tier: str, path: Path, master, lengths: tuple[int, ...], repeats: int,
            ) -> list[dict[str, float]]:  # noqa: ANN001
    from pdserve.cluster.config import engine_config
    from pdserve.cluster.kv_store_section import KVStoreSection
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.tiers.mooncake import MooncakeBlockStore

    blocks = max(lengths) // 16 + 2
    host_gb = 0.5 if tier == "host" else 0.0
    # Every hit loads (kv_load_policy always): this measures what the cost model estimates.
    engine = LLMEngine(engine_config(str(path), num_kv_blocks=blocks, host_kv_cache_gb=host_gb,
                                     max_num_batched_tokens=max(lengths) + 16,
                                     kv_load_policy="always"))
    if tier == "store":
        section = KVStoreSection(enabled=True, master_address=master.rpc_address,
                                 metadata_server=master.metadata_server, segment_mb=512,
                                 staging_mb=64)
        engine.tiers.attach_store(MooncakeBlockStore(section.client_settings("127.0.0.1")))
    assert engine.scheduler.loads is not None
    vocab = engine.loaded.config.vocab_size
    rng = random.Random(0)
    draw = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    first_token_s(engine, "warm", draw(max(lengths)))  # first calls, allocations
    rows = []
    for length in lengths:
        compute, load, model_load = [], [], []
        for k in range(repeats):
            prompt = draw(length) + [1]
            miss_s, _ = first_token_s(engine, f"miss-{length}-{k}", prompt)
            settle(engine)
            first_token_s(engine, f"flush-{length}-{k}", draw(max(lengths)))  # evicts it
            settle(engine)
            hit_s, reuse = first_token_s(engine, f"hit-{length}-{k}", prompt)
            settle(engine)
            if reuse is None or not reuse.num_loaded_tokens:
                continue
            compute.append(miss_s)
            load.append(hit_s)
            model_load.append(reuse.load_s or 0.0)
        if compute:
            rows.append({"tokens": length, "compute_ms": 1000 * min(compute),
                         "load_first_token_ms": 1000 * min(load),
                         "copy_ms": 1000 * min(model_load)})
    engine.close()
    return rows


def crossover(rows: list[dict[str, float]]) -> int | None:
    return next((r["tokens"] for r in rows if r["load_first_token_ms"] < r["compute_ms"]), None)


def main() -> int:
    offline()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "medium", "small"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    set_threads(args.threads)
    from pdserve.cluster.kv_store_master import local_master

    path = ensure_checkpoint(Path.home() / ".cache" / "pdserve" / "models", "llama", args.size)
    results = {}
    with local_master() as master:
        for tier in ("host", "store"):
            results[tier] = measure(tier, path, master, LENGTHS, args.repeats)
    print(f"load or recompute, llama {args.size}, {args.threads} thread(s), best of "
          f"{args.repeats} (ms to the first token; copy = the tier's verified copy alone)")
    print(f"{'tokens':>7} | {'compute':>9} | {'host load':>9} {'copy':>7} | "
          f"{'store load':>10} {'copy':>7}")
    by_len = {t: {r["tokens"]: r for r in rows} for t, rows in results.items()}
    for length in LENGTHS:
        c = by_len["host"].get(length) or by_len["store"].get(length)
        if c is None:
            continue
        h, s = by_len["host"].get(length, {}), by_len["store"].get(length, {})
        print(f"{length:>7} | {c['compute_ms']:>9.1f} | "
              f"{h.get('load_first_token_ms', float('nan')):>9.1f} "
              f"{h.get('copy_ms', float('nan')):>7.2f} | "
              f"{s.get('load_first_token_ms', float('nan')):>10.1f} "
              f"{s.get('copy_ms', float('nan')):>7.2f}")
    for tier, rows in results.items():
        print(f"crossover ({tier}): loading wins from {crossover(rows)} tokens")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = RESULTS_DIR / f"kv_crossover_{args.size}.json"
    out.write_text(json.dumps({"size": args.size, "threads": args.threads, **results}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        compute = results["host"] or results["store"]
        ax.plot([r["tokens"] for r in compute], [r["compute_ms"] for r in compute], "o-",
                label="recompute")
        for tier, rows in results.items():
            ax.plot([r["tokens"] for r in rows], [r["load_first_token_ms"] for r in rows], "s--",
                    label=f"load from {tier}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prefix tokens")
        ax.set_ylabel("time to first token (ms)")
        ax.set_title(f"load or recompute (llama {args.size}, CPU)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(RESULTS_DIR / f"kv_crossover_{args.size}.png", dpi=110)
    except ImportError:
        pass
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
