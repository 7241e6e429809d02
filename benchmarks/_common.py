"""Helpers shared by pdserve's benchmarks: checkpoints, thread setup, progress, results, plots.

Benchmarks are scripts, not tests: they print what they measure and save it under results/.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_MODEL_DIR = Path.home() / ".cache" / "pdserve" / "models"


def add_model_args(p: Any) -> None:
    """--model-dir (where generated checkpoints are kept) and --seed (the workload's RNG)."""
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    p.add_argument("--seed", type=int, default=0)


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
    fmt: str = "%.0f",
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
        ax.bar_label(drawn, fmt=fmt)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.margins(y=0.15)
    return save_figure(fig, name, suptitle)


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
def started_pair(start: Callable[[str], tuple[Any, Callable[[], None]]],
                 ) -> Iterator[tuple[Any, Any]]:
    """A receiver and a sender process, each started by ``start(role)`` -> (its pipe, a
    function that joins it, killing it after 30 s), driven by (op, args) tuples and saying
    "up" first; yields their pipes (receiver, sender). On exit each gets ("stop", None)."""
    pipes, joins = [], []
    try:
        for role in ("receiver", "sender"):
            pipe, join = start(role)
            pipes.append(pipe)
            joins.append(join)
        for pipe in pipes:
            assert pipe.recv() == "up"
        yield pipes[0], pipes[1]
    finally:
        for pipe in pipes:
            pipe.send(("stop", None))
        for join in joins:
            join()


def role_pair(target: Any, args: Any) -> AbstractContextManager[tuple[Any, Any]]:
    """`started_pair` of two spawned processes on this machine, ``target(conn, role, *args)``."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")

    def start(role: str) -> tuple[Any, Callable[[], None]]:
        parent, child = ctx.Pipe()
        process = ctx.Process(target=target, args=(child, role, *args))
        process.start()

        def join() -> None:
            process.join(30)
            if process.is_alive():
                process.kill()
        return parent, join
    return started_pair(start)


def transfer_block_ids(rng: Any, size: int, num_cache_blocks: int,
                       contiguous: bool) -> tuple[list[int], list[int]]:
    """(source, destination) block ids of one benchmark transfer of ``size`` blocks: the last
    blocks of the source cache and a run at a random place, or random ids on both sides."""
    if contiguous:
        start = rng.randrange(num_cache_blocks - size + 1)
        return (list(range(num_cache_blocks - size, num_cache_blocks)),
                list(range(start, start + size)))
    return rng.sample(range(num_cache_blocks), size), rng.sample(range(num_cache_blocks), size)
