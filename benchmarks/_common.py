"""Helpers shared by pdserve's benchmarks: checkpoints, thread setup, progress, results, plots.

Benchmarks are scripts, not tests: they print what they measure and save it under results/.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    import httpx

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_MODEL_DIR = Path.home() / ".cache" / "pdserve" / "models"


def offline() -> None:
    """Benchmarks never touch the network: every checkpoint is generated locally."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def ensure_checkpoint(
    model_dir: Path, family: str, size: str, seed: int = 0, dtype: str = "float32"
) -> Path:
    """Path of a generated checkpoint, making it (deterministically) on first use.

    Written to a temporary sibling and renamed, so an interrupted run never leaves a
    half-written checkpoint that a later run would trust.
    """
    from pdserve.engine.checkpoint_maker import make_checkpoint

    suffix = "" if dtype == "float32" else f"-{dtype}"
    target = model_dir / f"{family}-{size}-seed{seed}{suffix}"
    if (target / "config.json").is_file():
        return target
    model_dir.mkdir(parents=True, exist_ok=True)
    print(f"generating the {family} {size} checkpoint into {target} (once) ...", flush=True)
    started = time.perf_counter()
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=model_dir))
    try:
        make_checkpoint(staging, family, size, seed=seed, dtype=dtype)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    print(f"  done in {time.perf_counter() - started:.1f} s", flush=True)
    return target


def set_threads(num_threads: int) -> str:
    """Pin torch's intra-op threads; returns a line describing the machine's load."""
    torch.set_num_threads(num_threads)
    cores = os.cpu_count() or 0
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    line = f"threads: {num_threads} of {cores} cores; 1-min load average before start {load:.2f}"
    if load > 0.5 or cores <= num_threads:
        line += (
            "\n  NOTE: this box is shared (or fully used by the benchmark): other processes "
            "take CPU time and\n  distort the numbers, not always alike (a descheduled "
            "thread stalls every parallel op);\n  trust runs whose load average stays "
            "below the core count, and compare CPU time too."
        )
    return line


class Progress:
    """Prints a status line at most every `every_s` seconds (and always when forced)."""

    def __init__(self, label: str, every_s: float = 5.0) -> None:
        self.label = label
        self.every_s = every_s
        self.started = time.perf_counter()
        self._last = self.started

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def update(self, message: str, force: bool = False) -> None:
        now = time.perf_counter()
        if force or now - self._last >= self.every_s:
            self._last = now
            print(f"  [{self.label} {now - self.started:6.1f} s] {message}", flush=True)


def save_json(name: str, results: dict[str, Any]) -> Path:
    """Write `results` (plus the command line) to results/<name>.json; returns the path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    payload = {"command": " ".join(sys.argv), "timestamp": time.time(), **results}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def bar_chart(
    name: str,
    panels: Sequence[tuple[str, str, dict[str, float]]],
    suptitle: str,
) -> Path:
    """Save one PNG with a bar panel per (title, y label, {bar: value}); returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    colors = ["#3b7dd8", "#e08a2e", "#5aa469", "#b05bc4"]
    for ax, (title, ylabel, bars) in zip(axes[0], panels, strict=True):
        labels, values = list(bars), list(bars.values())
        drawn = ax.bar(labels, values, color=colors[: len(labels)])
        ax.bar_label(drawn, fmt="%.0f")
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.margins(y=0.15)
    return save_figure(fig, name, suptitle)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS says is free right now (benchmarks never hard-code ports)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


_PROM_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*(?:\{[^}]*\})?)\s+(\S+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """Samples of a Prometheus text exposition, keyed ``name{labels}`` as written."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        match = _PROM_SAMPLE.match(line)
        if match and not line.startswith("#"):
            samples[match.group(1)] = float(match.group(2))
    return samples


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a local process from /proc; NaN once it is gone (Linux only)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    # After the command name: state is field 3, utime 14 and stime 15 (1-based, man proc).
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_tree_cpu_seconds(root_pid: int) -> dict[int, float]:
    """CPU seconds of `root_pid` and every descendant, by pid (a local Ray started by this
    process is its descendant: raylet, GCS, and every worker)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # exited while we looked
        children.setdefault(ppid, []).append(int(entry.name))
    usage: dict[int, float] = {}
    stack = [root_pid]
    while stack:
        pid = stack.pop()
        seconds = process_cpu_seconds(pid)
        if not math.isnan(seconds):
            usage[pid] = seconds
        stack.extend(children.get(pid, ()))
    return usage


def machine_cpu_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, summed over cores (Linux)."""
    try:
        values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except OSError:
        return math.nan, math.nan
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    ticks = os.sysconf("SC_CLK_TCK")
    return (sum(values) - idle) / ticks, sum(values) / ticks


def comparison_chart(
    name: str,
    cdf_panels: Sequence[tuple[str, str, Mapping[str, Sequence[float]]]],
    bar_panels: Sequence[tuple[str, str, Mapping[str, Mapping[str, float]]]],
    suptitle: str,
) -> Path:
    """One PNG: CDF panels (title, x label, {series: samples}) on a log x axis, then grouped
    bar panels (title, y label, {group: {series: value}}); returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    num = len(cdf_panels) + len(bar_panels)
    fig, axes = plt.subplots(1, num, figsize=(5 * num, 4), squeeze=False)
    colors = ["#3b7dd8", "#e08a2e", "#5aa469", "#b05bc4"]
    for ax, (title, xlabel, series) in zip(axes[0], cdf_panels, strict=False):
        for color, (label, samples) in zip(colors, series.items(), strict=False):
            ordered = sorted(v for v in samples if v > 0)
            if ordered:
                ys = [(i + 1) / len(ordered) for i in range(len(ordered))]
                ax.step(ordered, ys, where="post", color=color, label=f"{label} (n={len(ordered)})")
        ax.set_xscale("log")
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("fraction <= x")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    for ax, (title, ylabel, groups) in zip(axes[0][len(cdf_panels):], bar_panels, strict=True):
        series_names = list(dict.fromkeys(s for bars in groups.values() for s in bars))
        width = 0.8 / max(len(series_names), 1)
        for k, (series_name, color) in enumerate(zip(series_names, colors, strict=False)):
            xs = [i + k * width for i in range(len(groups))]
            heights = [bars.get(series_name, math.nan) for bars in groups.values()]
            drawn = ax.bar(xs, heights, width, color=color, label=series_name)
            ax.bar_label(drawn, fmt="%.0f", fontsize=7)
        ax.set_xticks([i + width * (len(series_names) - 1) / 2 for i in range(len(groups))])
        ax.set_xticklabels(list(groups), fontsize=8)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.margins(y=0.15)
        ax.legend()
    return save_figure(fig, name, suptitle)


# ---- HTTP serving benchmarks --------------------------------------------------------------
class StreamFailed(Exception):
    """The server answered with an error status, or sent an error event inside the stream."""


@dataclass(frozen=True)
class SSEStream:
    """What a client saw of one streamed OpenAI response (perf_counter times)."""

    first_event_at: float  # first event carrying choices (NaN: none came)
    content_times: tuple[float, ...]  # events carrying non-empty text
    completion_tokens: int  # from the usage chunk (0: none came)


async def read_sse_stream(
    client: httpx.AsyncClient, url: str, body: Mapping[str, Any]
) -> SSEStream:
    """POST a streaming chat or text completion and time its events; raises StreamFailed."""
    first = math.nan
    content_times: list[float] = []
    num_tokens = 0
    async with client.stream("POST", url, json=dict(body)) as response:
        if response.status_code != 200:
            await response.aread()
            raise StreamFailed(f"HTTP {response.status_code}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            now = time.perf_counter()
            event = json.loads(data)
            if "error" in event:
                raise StreamFailed(f"in-stream error: {str(event['error'].get('message'))[:80]}")
            if event.get("usage"):
                num_tokens = int(event["usage"]["completion_tokens"])
            choices = event.get("choices") or []
            if choices and math.isnan(first):
                first = now
            text = "".join(c.get("text") or (c.get("delta") or {}).get("content") or ""
                           for c in choices)
            if text:
                content_times.append(now)
    return SSEStream(first, tuple(content_times), num_tokens)


@contextmanager
def local_serve_apps(
    configs: Mapping[str, Mapping[str, Any]], num_cpus: int, host: str = "127.0.0.1",
    env_vars: Mapping[str, str] | None = None,
) -> Iterator[str]:
    """A fresh local Ray and one Serve HTTP port (free, on `host`) running one pdserve app per
    {name: config mapping} under /<name>; yields the base URL. Serve and Ray are shut down on
    the way out, errors and Ctrl-C included. `env_vars` reach every Ray worker (job-wide)."""
    import logging

    import ray
    from ray import serve

    from pdserve.cluster.app import build_from_config
    from pdserve.cluster.config import parse_config

    port = free_port(host)
    # address="local": always a fresh instance of our own, never a cluster found on the machine.
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING, runtime_env={"env_vars": dict(env_vars or {})})
    try:
        serve.start(http_options={"host": host, "port": port})
        for name, config in configs.items():
            cfg = parse_config(config, source=f"benchmark app {name}")
            print(f"deploying {name} ({cfg.mode}) ...", flush=True)
            serve.run(build_from_config(cfg), name=name, route_prefix=f"/{name}")
        yield f"http://{host}:{port}"
    finally:
        print("shutting down Serve and Ray ...", flush=True)
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def probe_serve_replicas() -> list[dict[str, Any]]:
    """app, deployment, pid, torch threads and OMP_NUM_THREADS of every live Serve replica."""
    import ray

    def probe(_replica: Any) -> dict[str, Any]:
        # Runs inside the replica; a nested function so cloudpickle ships it by value.
        import os

        import torch

        return {"pid": os.getpid(), "torch_threads": torch.get_num_threads(),
                "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}

    found: list[dict[str, Any]] = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if not name.startswith("SERVE_REPLICA::"):
            continue
        app, deployment = name.split("::", 1)[1].split("#")[:2]
        actor = ray.get_actor(name, namespace=entry["namespace"])
        info = cast(dict[str, Any], ray.get(actor.__ray_call__.remote(probe), timeout=60))
        found.append({"app": app, "deployment": deployment, **info})
    return sorted(found, key=lambda r: (r["app"], r["deployment"], r["pid"]))


def save_figure(fig: Any, name: str, suptitle: str) -> Path:
    """Title, lay out, write results/NAME.png and close: the end of every plot here."""
    import matplotlib.pyplot as plt

    fig.suptitle(suptitle)
    fig.tight_layout()
    path = RESULTS_DIR / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


@contextmanager
def role_pair(target: Any, args: Any) -> Iterator[tuple[Any, Any]]:
    """A receiver and a sender process (``target(conn, role, *args)``, spawned), each driven by
    (op, args) tuples over a pipe and saying "up" first; yields their pipes (receiver,
    sender). On exit each gets ("stop", None) and is joined (killed after 30 s)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    pipes, processes = [], []
    try:
        for role in ("receiver", "sender"):
            parent, child = ctx.Pipe()
            process = ctx.Process(target=target, args=(child, role, *args))
            process.start()
            pipes.append(parent)
            processes.append(process)
        for pipe in pipes:
            assert pipe.recv() == "up"
        yield pipes[0], pipes[1]
    finally:
        for pipe in pipes:
            pipe.send(("stop", None))
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()


def transfer_block_ids(rng: Any, size: int, num_cache_blocks: int,
                       contiguous: bool) -> tuple[list[int], list[int]]:
    """(source, destination) block ids of one benchmark transfer of ``size`` blocks: the last
    blocks of the source cache and a run at a random place, or random ids on both sides."""
    if contiguous:
        start = rng.randrange(num_cache_blocks - size + 1)
        return (list(range(num_cache_blocks - size, num_cache_blocks)),
                list(range(start, start + size)))
    return rng.sample(range(num_cache_blocks), size), rng.sample(range(num_cache_blocks), size)
