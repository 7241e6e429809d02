"""Serving overhead: one workload offline through `LLMEngine` and over HTTP through `pdserve
serve` (colocated and disaggregated), side by side in one run, as ratios to the engine.

Placement (default `pinned`): every worker on a core of its own with one torch thread (decode
on core 1, prefill on core 0), the offline engine on core 1 with one thread; `floating`: no
pinning, colocated on 2 CPUs with 2 threads. Offline runs replay the same arrival times at the
decode replica's thread count; served runs stream `/v1/completions`, timing every chunk.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import add_model_args, bar_chart, ensure_checkpoint, offline, save_json
from _overhead_runs import Request, RunResult, pdserve_serve, run_offline, run_served
from _proc_cpu import ENGINE_THREAD, busiest_threads

from pdserve.bench.arrivals import arrival_times
from pdserve.bench.workloads import PromptSpec
from pdserve.cluster.config import PdserveConfig
from pdserve.cluster.wiring import wire

NUM_SPECIAL_TOKENS = 3  # ids 0..2 are the generator's special tokens; prompts avoid them
MODEL_NAME = "m"
SIZES = {"small": "float32", "medium": "bfloat16"}
MODES = ("colocated", "disaggregated")
DECODE_CORE, PREFILL_CORE = 1, 0  # pinned placement
WORKLOADS = ("decode", "prompt", "mixed")
IDLE_PROBES = 5  # short requests sent one by one to an idle server: the idle TTFT


@dataclass(frozen=True)
class Shape:
    """Lengths of one workload, scaled by --scale."""

    name: str
    requests: list[Request]
    full_batch: int | None  # decode: the batch whose step time TPOT is held against


def _prompt(rng: np.random.Generator, vocab: int, n: int, out: int) -> PromptSpec:
    return PromptSpec(tuple(rng.integers(NUM_SPECIAL_TOKENS, vocab, size=n).tolist()), out)


def make_workload(name: str, vocab: int, scale: float, seed: int) -> Shape:
    """decode: 32 at once, 40 in, 128 out. prompt: 24 of 600 in, 64 out, Poisson 4/s. mixed:
    long prompts (1,536 in, 32 out) at 0.5/s among short streams (40 in, 64 out) at 4/s."""
    rng = np.random.default_rng(seed)
    s = lambda n: max(2, round(n * scale))  # noqa: E731
    if name == "decode":
        return Shape(name, [Request(_prompt(rng, vocab, 40, s(128)), "short", 0.0)
                            for _ in range(32)], full_batch=32)
    if name == "prompt":
        times = arrival_times(24, 4.0, seed=seed)
        return Shape(name, [Request(_prompt(rng, vocab, s(600), 64), "long", t)
                            for t in times], None)
    duration = 24.0 * scale
    requests = []
    for kind, rate, n_in, n_out, offset in (("long", 0.5, s(1536), 32, 1),
                                            ("short", 4.0, 40, 64, 2)):
        for t in arrival_times(max(2, round(rate * duration)), rate, seed=seed + offset):
            requests.append(Request(_prompt(rng, vocab, n_in, n_out), kind, t))
    return Shape(name, sorted(requests, key=lambda r: r.arrival_s), None)


def decode_threads(mode: str, pinned: bool) -> int:
    """Torch threads of the decode replica: one per core it owns."""
    return 2 if mode == "colocated" and not pinned else 1


def server_config(path: Path, dtype: str, mode: str, port: int,
                  pinned: bool, frontend: str = "direct") -> dict[str, Any]:
    decode_cpus = decode_threads(mode, pinned)
    roles: dict[str, Any] = {"decode": {"replicas": 1, "resources": {"num_cpus": decode_cpus}}}
    engine: dict[str, Any] = {"num_kv_blocks": 2048, "max_num_seqs": 64, "device": "cpu"}
    if mode == "disaggregated":
        roles["prefill"] = {"replicas": 1, "resources": {"num_cpus": 1}}
    if pinned:
        engine["cpu_affinity"] = {"decode": [str(DECODE_CORE)]}
        if mode == "disaggregated":
            engine["cpu_affinity"]["prefill"] = [str(PREFILL_CORE)]
    router: dict[str, Any] = {"min_disaggregated_prompt_tokens": 32, "max_in_flight_requests": 256,
                              "request_timeout_s": 600}
    return {"model": {"path": str(path), "dtype": dtype}, "served_model_name": MODEL_NAME,
            "engine": engine, "router": router, "handoff": {"timeout_s": 60},
            "http": {"host": "127.0.0.1", "port": port, "frontend": frontend}, "mode": mode,
            "roles": roles}


def offline_runs(cfg: PdserveConfig, path: Path, threads: int, shapes: list[Shape],
                 pinned: bool) -> dict[str, RunResult]:
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    torch.set_num_threads(threads)
    all_cores = os.sched_getaffinity(0)
    if pinned:
        os.sched_setaffinity(0, {DECODE_CORE})
    engine = LLMEngine(wire(cfg).engine)
    engine.generate([list(range(NUM_SPECIAL_TOKENS, NUM_SPECIAL_TOKENS + 32))],
                    SamplingParams(max_tokens=4, temperature=0.0))
    results = {}
    for shape in shapes:
        print(f"  offline, {threads} thread(s): {shape.name} ...", flush=True)
        results[shape.name] = run_offline(engine, shape.requests, shape.full_batch)
    del engine
    gc.collect()
    os.sched_setaffinity(0, all_cores)
    return results


def served_runs(config: dict[str, Any], port: int, shapes: list[Shape], label: str
                ) -> tuple[dict[str, RunResult], float]:
    """Every workload against one `pdserve serve`; also the idle TTFT of a short prompt."""
    idle = Shape("idle", [Request(r.prompt, "short", float(i))
                          for i, r in enumerate(shapes[0].requests[:IDLE_PROBES])], None)
    with pdserve_serve(config, Path(tempfile.mkdtemp(prefix="pdserve-overhead-")),
                       port) as served:
        probe = run_served(served, MODEL_NAME, idle.requests, f"{label} idle")
        results = {s.name: run_served(served, MODEL_NAME, s.requests, f"{label} {s.name}")
                   for s in shapes}
    return results, probe.pct("ttft_s", 50)


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:,.1f}"


def report(size: str, shape: Shape, offline_by_threads: dict[int, RunResult],
           served: dict[str, tuple[RunResult, float]], pinned: bool) -> dict[str, Any]:
    """Print one workload's table; returns its figures for the JSON."""
    print(f"\n--- {size} / {shape.name}: {len(shape.requests)} requests ---")
    print(f"{'path':<26}{'tok/s':>9}{'x offline':>10}{'TTFT p50':>10}{'TTFT p90':>10}"
          f"{'TPOT p50':>10}{'TPOT p99':>10}{'step':>8}{'TPOT/step':>10}")
    rows: dict[str, Any] = {}
    for threads, run in offline_by_threads.items():
        rows[f"offline-{threads}t"] = _row(f"offline ({threads} thread(s))", run, run)
    for label, (run, _idle) in served.items():
        mode = label.split(" ")[0]
        rows[label] = _row(label, run, offline_by_threads[decode_threads(mode, pinned)])
        if run.failed:
            print(f"    {run.failed} failed: {'; '.join(run.notes)[:200]}")
    print("  CPU per output token, us (served: each role's process, and its engine thread):")
    for label, (run, _idle) in served.items():
        base = offline_by_threads[decode_threads(label.split(" ")[0], pinned)]
        rows[label].update(cpu_report(label, run, base))
    if shape.name == "mixed":
        print("  short streams among long prompts:")
        for label, (run, idle) in served.items():
            base = offline_by_threads[decode_threads(label.split(" ")[0], pinned)]
            p50, p99 = run.pct("tpot_s", 50, "short"), run.pct("tpot_s", 99, "short")
            ttft90 = run.pct("ttft_s", 90, "short")
            rows[label].update(short_tpot_p99_over_p50=p99 / p50,
                               short_tpot_p50_over_step=p50 / base.decode_step_s,
                               short_ttft_p90_over_idle=ttft90 / idle,
                               long_ttft_p50_s=run.pct("ttft_s", 50, "long"))
            print(f"    {label:<24} TPOT p50 {_ms(p50)} p99 {_ms(p99)} ms (p99/p50 "
                  f"{p99 / p50:.2f}, p50/step {p50 / base.decode_step_s:.2f}); TTFT p90 "
                  f"{_ms(ttft90)} ms vs idle {_ms(idle)} ({ttft90 / idle:.2f}x); long TTFT "
                  f"p50 {_ms(run.pct('ttft_s', 50, 'long'))} ms")
    return rows


def cpu_report(label: str, run: RunResult, base: RunResult) -> dict[str, float]:
    """Prints and returns the CPU each process spent per output token: outside the engine
    (ingress, proxy, the decode process's other threads) and the decode process against the
    offline engine's CPU per token."""
    us = run.cpu_us_per_token
    offline_us = base.cpu_us_per_token("engine")
    engine_key = f"decode.{ENGINE_THREAD}"
    decode_rest = us("decode") - us(engine_key)
    outside = us("ingress") + decode_rest + (us("proxy") if "proxy" in run.cpu_s else 0.0)
    figures = {"cpu_us_ingress": us("ingress"), "cpu_us_decode": us("decode"),
               "cpu_us_decode_engine": us(engine_key), "cpu_us_decode_rest": decode_rest,
               "cpu_us_prefill": us("prefill"), "cpu_us_proxy": us("proxy"),
               "cpu_us_outside_engine": outside, "cpu_us_offline": offline_us,
               "decode_cpu_over_offline": us("decode") / offline_us}
    print(f"    {label:<24} ingress {us('ingress'):,.0f}, decode {us('decode'):,.0f} (engine "
          f"thread {us(engine_key):,.0f}, other threads {decode_rest:,.0f}), prefill "
          f"{us('prefill'):,.0f}, proxy {us('proxy'):,.0f}; outside the engine {outside:,.0f}"
          f"; decode / offline engine ({offline_us:,.0f}) {figures['decode_cpu_over_offline']:.2f}")
    for role in ("decode", "ingress"):
        threads = ", ".join(f"{name} {seconds / max(run.num_tokens, 1) * 1e6:,.0f}"
                            for name, seconds in busiest_threads(run.cpu_s, role))
        print(f"    {'':<24}   {role} threads (us/token): {threads}")
    return figures


def _row(label: str, run: RunResult, base: RunResult) -> dict[str, float]:
    tpot50 = run.pct("tpot_s", 50)
    row = {"tok_per_s": run.tok_per_s(), "x_offline": run.tok_per_s() / base.tok_per_s(),
           "ttft_p50_s": run.pct("ttft_s", 50), "ttft_p90_s": run.pct("ttft_s", 90),
           "tpot_p50_s": tpot50, "tpot_p99_s": run.pct("tpot_s", 99),
           "step_s": base.decode_step_s, "tpot_over_step": tpot50 / base.decode_step_s,
           "failed": run.failed}
    print(f"  {label:<24}{row['tok_per_s']:>9,.0f}{row['x_offline']:>10.2f}"
          f"{_ms(row['ttft_p50_s']):>10}{_ms(row['ttft_p90_s']):>10}{_ms(tpot50):>10}"
          f"{_ms(row['tpot_p99_s']):>10}{_ms(base.decode_step_s):>8}"
          f"{row['tpot_over_step']:>10.2f}")
    return row


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["small", "medium"])
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--placement", choices=("pinned", "floating"), default="pinned",
                   help="pinned: each worker and the offline engine on a core of its own, "
                        "one thread; floating: no pinning, colocated with 2 threads")
    p.add_argument("--frontend", choices=("direct", "proxy"), default="direct",
                   help="http.frontend: each ingress replica's own port, or Serve's proxy")
    p.add_argument("--scale", type=float, default=1.0, help="shrink output and long lengths")
    p.add_argument("--port", type=int, default=18200, help="HTTP port of the served app")
    add_model_args(p)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    offline()
    started, results = time.perf_counter(), {}
    pinned = args.placement == "pinned"
    print(f"placement: {args.placement}; machine load {os.getloadavg()[0]:.2f}", flush=True)
    for size in args.sizes:
        path = ensure_checkpoint(args.model_dir, "llama", size, dtype=SIZES[size])
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(str(path)).vocab_size
        shapes = [make_workload(w, vocab, args.scale, args.seed) for w in args.workloads]
        base_cfg = PdserveConfig.model_validate(
            server_config(path, SIZES[size], "colocated", args.port, pinned=False))
        offline_by_threads = {t: offline_runs(base_cfg, path, t, shapes, pinned)
                              for t in sorted({decode_threads(m, pinned) for m in args.modes})}
        served: dict[str, dict[str, tuple[RunResult, float]]] = {s.name: {} for s in shapes}
        for mode in args.modes:
            config = server_config(path, SIZES[size], mode, args.port, pinned, args.frontend)
            runs, idle = served_runs(config, args.port, shapes, mode)
            for name, run in runs.items():
                served[name][mode] = (run, idle)
        for shape in shapes:
            results[f"{size}/{shape.name}"] = report(
                size, shape, {t: r[shape.name] for t, r in offline_by_threads.items()},
                served[shape.name], pinned)
    name = f"serving_overhead_{args.placement}"
    print(f"\nsaved {save_json(name, {'placement': args.placement, 'results': results})}")
    panels = [(key, "served / offline tok/s", {label.replace(' ', '\n'): row["x_offline"]
                                               for label, row in rows.items()})
              for key, rows in results.items()]
    plot = bar_chart(name, panels, "served / offline output tok/s", fmt="%.2f")
    print(f"plot {plot}")
    print(f"total benchmark time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
