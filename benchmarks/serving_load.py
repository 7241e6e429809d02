"""Serving load: disaggregated vs colocated pdserve over the real HTTP API, side by side.

One local Ray, one Serve HTTP port, two apps with the same total resources; prints ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from _common import (  # run as a script: python benchmarks/serving_load.py
    DEFAULT_MODEL_DIR,
    Progress,
    StreamFailed,
    ensure_checkpoint,
    local_serve_apps,
    machine_cpu_seconds,
    offline,
    parse_prometheus,
    probe_serve_replicas,
    process_tree_cpu_seconds,
    read_sse_stream,
)
from _serving_report import APPS, Measurement, RequestRecord, report, summarize

MODES = {"disagg": "disaggregated", "colo": "colocated"}
NUM_SPECIAL_TOKENS = 3  # ids 0..2 are the generator's special tokens; random prompts avoid them
HOST = "127.0.0.1"  # loopback only: the benchmark never listens on or calls another address


@dataclass(frozen=True)
class RequestSpec:
    kind: str  # "short": streamed chat; "long": a long token-id prompt (completions)
    at_s: float  # send time, seconds after the round started
    path: str
    body: dict[str, Any]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--duration-s", type=float, default=100.0,
                   help="measured load time per app, split over --rounds")
    p.add_argument("--rounds", type=int, default=2, help="rounds per app, alternating apps")
    p.add_argument("--short-rps", type=float, default=4.0, help="short chat streams per second")
    p.add_argument("--long-rps", type=float, default=0.5, help="long prompts per second")
    p.add_argument("--short-prompt-tokens", type=int, default=16)
    p.add_argument("--short-output-tokens", type=int, default=64)
    p.add_argument("--long-prompt-min", type=int, default=1000)
    p.add_argument("--long-prompt-max", type=int, default=2000)
    p.add_argument("--long-output-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=48, help="client-side in-flight cap")
    p.add_argument("--request-timeout-s", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0, help="workload RNG seed")
    p.add_argument("--size", default="tiny", choices=("tiny", "small"))
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    p.add_argument("--quick", action="store_true", help="smoke run, finishes in < 2 min")
    args = p.parse_args()
    if args.quick:
        args.duration_s, args.rounds, args.short_rps, args.long_rps = 16.0, 1, 3.0, 0.5
    if args.rounds < 1 or args.duration_s <= 0 or args.short_rps <= 0 or args.long_rps < 0:
        p.error("need --rounds >= 1, --duration-s > 0, --short-rps > 0, --long-rps >= 0")
    return args


# ---- workload ------------------------------------------------------------------------------
def short_message_pool(model_path: Path, num_tokens: int, count: int, seed: int) -> list[str]:
    """User messages of about `num_tokens` tokens: random windows of the shipped corpus."""
    from pdserve.engine.tokenizer import Tokenizer
    from pdserve.engine.tokenizer_maker import corpus_text

    tokenizer = Tokenizer.from_checkpoint(model_path)
    words = corpus_text().split()
    rng = random.Random(seed)
    messages = []
    for _ in range(count):
        start = rng.randrange(len(words) - 4 * num_tokens)
        ids = tokenizer.encode(" ".join(words[start : start + 4 * num_tokens]))
        messages.append(tokenizer.decode(ids[:num_tokens]).strip())
    return messages


def short_spec(args: argparse.Namespace, rng: random.Random, at_s: float, model: str,
               messages: list[str]) -> RequestSpec:
    body = {"model": model, "messages": [{"role": "user", "content": rng.choice(messages)}],
            "max_tokens": args.short_output_tokens, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    return RequestSpec("short", at_s, "/v1/chat/completions", body)


def long_spec(args: argparse.Namespace, rng: random.Random, at_s: float, model: str,
              vocab_size: int, length: int) -> RequestSpec:
    """Random token ids (no prefix-cache hits) sent as a token-id prompt: exact lengths."""
    prompt = [rng.randrange(NUM_SPECIAL_TOKENS, vocab_size) for _ in range(length)]
    body = {"model": model, "prompt": prompt, "max_tokens": args.long_output_tokens,
            "ignore_eos": True, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    return RequestSpec("long", at_s, "/v1/completions", body)


def make_schedule(args: argparse.Namespace, round_index: int, model: str, vocab_size: int,
                  messages: list[str]) -> list[RequestSpec]:
    """Poisson arrivals of both kinds over one round; the same round index gives both apps
    the same requests at the same times."""
    seconds = args.duration_s / args.rounds
    rng = random.Random(f"{args.seed}/{round_index}")
    specs: list[RequestSpec] = []
    t = rng.expovariate(args.short_rps)
    while t < seconds:
        specs.append(short_spec(args, rng, t, model, messages))
        t += rng.expovariate(args.short_rps)
    t = rng.expovariate(args.long_rps) if args.long_rps > 0 else seconds
    while t < seconds:
        length = rng.randint(args.long_prompt_min, args.long_prompt_max)
        specs.append(long_spec(args, rng, t, model, vocab_size, length))
        t += rng.expovariate(args.long_rps)
    return sorted(specs, key=lambda s: s.at_s)


def warmup_schedule(args: argparse.Namespace, model: str, vocab_size: int,
                    messages: list[str]) -> list[RequestSpec]:
    """A few of each kind, both extreme long lengths; its own seed, so no later prefix hits."""
    rng = random.Random(f"{args.seed}/warm-up")
    specs = [short_spec(args, rng, 0.25 * i, model, messages) for i in range(6)]
    specs += [long_spec(args, rng, 0.3 + i, model, vocab_size, length)
              for i, length in enumerate((args.long_prompt_min, args.long_prompt_max))]
    return sorted(specs, key=lambda s: s.at_s)


# ---- client --------------------------------------------------------------------------------
async def run_request(client: httpx.AsyncClient, base_url: str, spec: RequestSpec,
                      scheduled: float, gate: asyncio.Semaphore) -> RequestRecord:
    capped = gate.locked()
    async with gate:
        lag = time.perf_counter() - scheduled
        error: str | None = None
        try:
            stream = await read_sse_stream(client, base_url + spec.path, spec.body)
        except StreamFailed as exc:
            error = str(exc)
        except httpx.HTTPError as exc:
            error = type(exc).__name__
    done = time.perf_counter()
    if error is not None:
        return RequestRecord(spec.kind, math.nan, math.nan, (), 0, 0, done - scheduled, lag,
                             capped, error)
    times, num_tokens = stream.content_times, stream.completion_tokens
    if num_tokens == 0:
        error = "stream ended without usage"
    ttft = (times[0] if times else stream.first_event_at) - scheduled
    gaps = tuple(b - a for a, b in zip(times, times[1:], strict=False))
    tpot = (times[-1] - times[0]) / (num_tokens - 1) if len(times) > 1 and num_tokens > 1 \
        else math.nan
    return RequestRecord(spec.kind, ttft, tpot, gaps, num_tokens, len(times), done - scheduled,
                         lag, capped, error)


async def run_round(base_url: str, specs: list[RequestSpec], args: argparse.Namespace,
                    label: str) -> tuple[list[RequestRecord], float]:
    """Send every request at its time, wait (bounded) for all; returns records and wall time."""
    gate = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency,
                          max_keepalive_connections=args.concurrency)
    timeout = httpx.Timeout(args.request_timeout_s, connect=10.0)
    progress = Progress(label)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        started = time.perf_counter()
        tasks: list[asyncio.Task[RequestRecord]] = []
        for spec in specs:
            await asyncio.sleep(max(0.0, started + spec.at_s - time.perf_counter()))
            tasks.append(asyncio.create_task(
                run_request(client, base_url, spec, started + spec.at_s, gate)))
            progress.update(_round_status(tasks, len(specs)))
        deadline = time.perf_counter() + args.request_timeout_s + 5.0
        pending = {t for t in tasks if not t.done()}
        while pending and time.perf_counter() < deadline:
            _, pending = await asyncio.wait(pending, timeout=1.0)
            progress.update(_round_status(tasks, len(specs)) + " (draining)")
        for task in pending:
            task.cancel()
        wall = time.perf_counter() - started
    records = [t.result() if not t.cancelled() else _cancelled(spec)
               for t, spec in zip(tasks, specs, strict=True)]
    progress.update(_round_status(tasks, len(specs)) + f"; round took {wall:.1f} s", force=True)
    return records, wall


def _cancelled(spec: RequestSpec) -> RequestRecord:
    return RequestRecord(spec.kind, math.nan, math.nan, (), 0, 0, math.nan, math.nan, False,
                         "cancelled at the drain deadline")


def _round_status(tasks: list[asyncio.Task[RequestRecord]], total: int) -> str:
    finished = [t.result() for t in tasks if t.done() and not t.cancelled()]
    errors = sum(r.error is not None for r in finished)
    return (f"sent {len(tasks)}/{total}, done {len(finished)}, in flight "
            f"{len(tasks) - len(finished)}, errors {errors}")


# ---- the two apps on one local Ray -------------------------------------------------------
def app_config(model_path: Path, mode: str) -> dict[str, Any]:
    """Same model, engine settings and 2 CPUs of replicas for both modes."""
    roles: dict[str, Any] = {"decode": {"replicas": 2 if mode == "colocated" else 1,
                                        "resources": {"num_cpus": 1}}}
    if mode == "disaggregated":
        roles["prefill"] = {"replicas": 1, "resources": {"num_cpus": 1}}
    return {
        "model": {"path": str(model_path), "dtype": "float32"},
        "engine": {"block_size": 16, "num_kv_blocks": 512, "max_num_batched_tokens": 1024,
                   "max_num_seqs": 32, "enable_prefix_caching": True, "device": "cpu"},
        "mode": mode,
        "roles": roles,
        "router": {"min_disaggregated_prompt_tokens": 64, "max_queued_requests": 256,
                   "request_timeout_s": 120.0, "num_cpus": 0.0},
        "handoff": {"timeout_s": 30.0, "staging_buffer_mb": 32},
    }


def scrape_metrics(base_url: str, app: str) -> dict[str, float]:
    response = httpx.get(f"{base_url}/{app}/metrics", timeout=30.0, trust_env=False)
    response.raise_for_status()
    return parse_prometheus(response.text)


# ---- the run -----------------------------------------------------------------------------
def measure(args: argparse.Namespace, base_url: str, model: str, vocab_size: int,
            messages: list[str]) -> Measurement:
    """Warm both apps up, then the measured rounds, alternating which app goes first."""
    replicas = probe_serve_replicas()
    for replica in replicas:
        print(f"  replica {replica['app']}/{replica['deployment']}: pid {replica['pid']}, torch "
              f"threads {replica['torch_threads']}, OMP_NUM_THREADS={replica['omp_num_threads']}")
    for app in APPS:
        print(f"warm-up {app} ...", flush=True)
        warmup = warmup_schedule(args, model, vocab_size, messages)
        asyncio.run(run_round(f"{base_url}/{app}", warmup, args, f"{app} warm-up"))
    before = {app: scrape_metrics(base_url, app) for app in APPS}
    records: dict[str, list[RequestRecord]] = {app: [] for app in APPS}
    walls = dict.fromkeys(APPS, 0.0)
    segments = []
    per_round: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for app in APPS if r % 2 == 0 else APPS[::-1]:
            specs = make_schedule(args, r, model, vocab_size, messages)
            print(f"{app} round {r + 1}/{args.rounds}: {len(specs)} requests "
                  f"({sum(s.kind == 'long' for s in specs)} long) over "
                  f"{args.duration_s / args.rounds:.0f} s", flush=True)
            cpu_before = cpu_snapshot()
            recs, wall = asyncio.run(run_round(f"{base_url}/{app}", specs, args,
                                               f"{app} {r + 1}/{args.rounds}"))
            segments.append(cpu_usage(app, r, wall, cpu_before, cpu_snapshot(), replicas))
            records[app] += recs
            walls[app] += wall
            per_round.append({"app": app, "round": r, "summary": summarize(recs, wall)})
    after = {app: scrape_metrics(base_url, app) for app in APPS}
    return Measurement(replicas, records, walls, segments, per_round, before, after)


def cpu_snapshot() -> dict[str, Any]:
    """CPU seconds so far: this process tree (client, Ray, every replica) and the machine."""
    busy, total = machine_cpu_seconds()
    return {"tree": process_tree_cpu_seconds(os.getpid()), "busy": busy, "total": total}


def cpu_usage(app: str, round_index: int, wall: float, before: dict[str, Any],
              after: dict[str, Any], replicas: list[dict[str, Any]]) -> dict[str, Any]:
    """Average cores each party used during one round."""
    used = {pid: s - before["tree"].get(pid, 0.0) for pid, s in after["tree"].items()}
    cores = {name: sum(used.get(r["pid"], 0.0) for r in replicas if r["app"] == name) / wall
             for name in APPS}
    cores["client"] = used.get(os.getpid(), 0.0) / wall
    tree = sum(used.values()) / wall
    cores["ray_and_serve_other"] = tree - sum(cores[k] for k in (*APPS, "client"))
    cores["machine_busy"] = (after["busy"] - before["busy"]) / wall
    cores["outside_this_benchmark"] = cores["machine_busy"] - tree
    cores["machine_cores"] = (after["total"] - before["total"]) / wall
    return {"app": app, "round": round_index, "wall_s": wall, "cores": cores}


def _interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # SIGTERM takes the same clean-up path as Ctrl-C


def main() -> None:
    args = parse_args()
    offline()
    signal.signal(signal.SIGTERM, _interrupt)
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    path = ensure_checkpoint(args.model_dir, "llama", args.size)
    vocab_size = int(json.loads((path / "config.json").read_text())["vocab_size"])
    messages = short_message_pool(path, args.short_prompt_tokens, 256, args.seed)
    configs = {app: app_config(path, MODES[app]) for app in APPS}
    model = path.name  # served model name: the checkpoint directory's name
    try:
        with local_serve_apps(configs, num_cpus=4, host=HOST,
                              env_vars={"OMP_NUM_THREADS": "1"}) as base_url:
            signal.signal(signal.SIGTERM, _interrupt)  # again: ray.init installs its own
            print(f"serving at {base_url}/{{{','.join(APPS)}}} after "
                  f"{time.perf_counter() - started:.1f} s", flush=True)
            measurement = measure(args, base_url, model, vocab_size, messages)
    except KeyboardInterrupt:
        print("interrupted: Serve and Ray were shut down; nothing saved", flush=True)
        raise SystemExit(130) from None
    report(args, measurement, load_before)
    print(f"total benchmark time {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
