"""KV handoff bandwidth: pdserve's handoff vs raw UCXX tagged sends of the same bytes (the
transport's ceiling), in-process memcpy, a plain TCP socket and the Ray object store between
two Ray nodes, for KV-shaped payloads of 1 to 256 MiB.

Run: ``python benchmarks/handoff_bandwidth.py [--sizes 1,4,16,64,256] [--reps 5] [--no-ray]``
Writes ``results/handoff_bandwidth.json`` and ``.png`` (GB/s and ratio to raw UCXX by size).

Every number is the median over ``--reps`` runs after one warm-up, on one machine:
- handoff: two spawned processes; from the first per-layer hook call on the sender to the
  receiver's ready future resolving (gather, digests, transfer, digest checks, scatter and
  fence included), with block ids scattered at random on both sides ("scattered") and each
  side's blocks in one run ("runs").
- raw ucxx: the same two processes, the same piece sizes as the handoff's plan, sent with
  UCXX tagged sends from one contiguous buffer into receives posted in advance on another:
  no gather, digest, header, fence or scatter. The handoff cannot beat it.
- memcpy: ``np.copyto`` of the same number of bytes in this process.
- tcp: two processes, ``sendall``/``recv_into`` over 127.0.0.1, first byte sent to last byte in.
- ray: two Ray nodes started here (``ray.cluster_utils.Cluster``: separate raylets and object
  stores, its own temp dir, shut down by its own pids); ``ray.put`` in an actor pinned to one
  node plus ``ray.get`` in an actor pinned to the other (both timed inside the actors).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from _bandwidth_peers import (
    BENCH_CONFIG,
    MIB,
    NUM_LAYERS,
    bench_layout,
    handoff_worker,
    tcp_receiver,
    tcp_sender,
)

Rates = dict[int, tuple[float, float]]  # size in MiB -> (GB/s, ms)


# ---- measurements ------------------------------------------------------------------------------
def median_rate(nbytes: int, timings: list[float]) -> tuple[float, float]:
    seconds = statistics.median(timings)
    return nbytes / seconds / 1e9, seconds * 1e3


def measure_memcpy(sizes: list[int], reps: int) -> Rates:
    results = {}
    for size in sizes:
        src = np.random.randint(0, 255, size * MIB, dtype=np.uint8)
        dst = np.empty_like(src)
        np.copyto(dst, src)  # warm-up: fault the pages in
        timings = []
        for _ in range(reps):
            started = time.perf_counter()
            np.copyto(dst, src)
            timings.append(time.perf_counter() - started)
        results[size] = median_rate(size * MIB, timings)
        report("memcpy", size, results[size])
    return results


def measure_pair(sizes: list[int], reps: int, pair: Any = None) -> dict[str, Rates]:
    """The handoff (scattered and consecutive blocks) and raw UCXX sends between the same two
    processes, alternating per repetition so the machine's drift hits all three alike.
    ``pair`` starts the two processes (default: `_common.role_pair`, both on this machine)."""
    from _common import role_pair, transfer_block_ids

    from pdserve.engine.kv.layout import KVSlice
    from pdserve.handoff import HandoffConfig
    from pdserve.handoff.plan import plan_pieces

    num_cache_blocks = max(sizes) + 8
    rng = random.Random(0)
    names = ("handoff scattered", "handoff runs", "raw ucxx")
    results: dict[str, Rates] = {name: {} for name in names}
    with (pair or role_pair)(handoff_worker, (num_cache_blocks,)) as (receiver, sender):
        receiver.send(("identity", None))
        address, host = receiver.recv()
        for size in sizes:
            defaults = HandoffConfig(**BENCH_CONFIG)
            kv = KVSlice.whole(bench_layout())
            plan = plan_pieces(kv, size, defaults.min_piece_bytes, defaults.max_piece_bytes)
            piece_sizes = [spec.nbytes(kv) for spec in plan]
            timings: dict[str, list[float]] = {name: [] for name in names}
            for rep in range(reps + 1):  # the first run warms staging pools and links
                for name in names:
                    if name == "raw ucxx":
                        elapsed = _raw_once(receiver, sender, address, host, rep, piece_sizes)
                    else:
                        src, dst = transfer_block_ids(rng, size, num_cache_blocks,
                                                      name.endswith("runs"))
                        elapsed = _handoff_once(receiver, sender, f"{size}-{rep}-{name}", src,
                                                dst)
                    if rep:
                        timings[name].append(elapsed)
            for name in names:
                results[name][size] = median_rate(size * MIB, timings[name])
                report(name, size, results[name][size])
    return results


def _handoff_once(receiver: Any, sender: Any, request_id: str, src: list[int],
                  dst: list[int]) -> float:
    receiver.send(("reserve", (request_id, dst)))
    sender.send(("push", (receiver.recv(), src)))
    receiver.send(("wait", request_id))
    ready_at, nbytes = receiver.recv()
    started, ok, error = sender.recv()
    if not ok:
        raise RuntimeError(f"handoff {request_id} failed: {error}")
    assert nbytes == len(src) * MIB
    return ready_at - started


def _raw_once(receiver: Any, sender: Any, address: bytes, host: str, rep: int,
              piece_sizes: list[int]) -> float:
    receiver.send(("raw_post", (rep, piece_sizes)))
    assert receiver.recv() == "posted"
    sender.send(("raw_send", (address, host, rep, piece_sizes)))
    started = sender.recv()
    return receiver.recv() - started


def measure_tcp(sizes: list[int], reps: int) -> Rates:
    ctx = multiprocessing.get_context("spawn")
    max_bytes = max(sizes) * MIB
    rx_parent, rx_child = ctx.Pipe()
    rx = ctx.Process(target=tcp_receiver, args=(rx_child, max_bytes))
    rx.start()
    tx_parent, tx_child = ctx.Pipe()
    tx = ctx.Process(target=tcp_sender, args=(tx_child, rx_parent.recv(), max_bytes))
    tx.start()
    results = {}
    try:
        for size in sizes:
            timings = []
            for rep in range(reps + 1):
                rx_parent.send(size * MIB)
                tx_parent.send(size * MIB)
                started, finished = tx_parent.recv(), rx_parent.recv()
                if rep:
                    timings.append(finished - started)
            results[size] = median_rate(size * MIB, timings)
            report("tcp", size, results[size])
    finally:
        rx_parent.send(0)
        tx_parent.send(0)
        for process in (rx, tx):
            process.join(30)
    return results


def measure_ray(sizes: list[int], reps: int) -> Rates:
    import ray
    from ray.cluster_utils import Cluster

    temp_dir = tempfile.mkdtemp(prefix="pdserve-bench-ray-")
    store = (max(sizes) * 4 + 256) * MIB
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"node_a": 1}, "object_store_memory": store,
        "temp_dir": temp_dir, "include_dashboard": False})
    cluster.add_node(num_cpus=1, resources={"node_b": 1}, object_store_memory=store)
    results = {}
    try:
        ray.init(address=cluster.address, logging_level=logging.ERROR)

        @ray.remote(num_cpus=0, resources={"node_a": 0.5})
        class Producer:
            def put(self, nbytes: int) -> tuple[list[Any], float]:
                payload = np.random.randint(0, 255, nbytes, dtype=np.uint8)
                started = time.perf_counter()
                ref = ray.put(payload)
                return [ref], time.perf_counter() - started  # a list: the ref stays a ref

        @ray.remote(num_cpus=0, resources={"node_b": 0.5})
        class Consumer:
            def get(self, refs: list[Any]) -> tuple[float, str]:
                started = time.perf_counter()
                value = ray.get(refs[0])
                elapsed = time.perf_counter() - started
                assert value.nbytes > 0
                return elapsed, ray.get_runtime_context().get_node_id()

        producer = Producer.remote()  # type: ignore[attr-defined]
        consumer = Consumer.remote()  # type: ignore[attr-defined]
        for size in sizes:
            timings = []
            for rep in range(reps + 1):
                refs, put_s = ray.get(producer.put.remote(size * MIB))
                get_s, _ = ray.get(consumer.get.remote(refs))
                del refs
                if rep:
                    timings.append(put_s + get_s)
            results[size] = median_rate(size * MIB, timings)
            report("ray object store", size, results[size])
    finally:
        ray.shutdown()
        cluster.shutdown()  # stops exactly the raylets/GCS this cluster started
        shutil.rmtree(temp_dir, ignore_errors=True)
    return results


# ---- reporting -----------------------------------------------------------------------------------
def report(name: str, size: int, rate: tuple[float, float]) -> None:
    print(f"  {name:>22s} {size:4d} MiB: {rate[0]:6.2f} GB/s  {rate[1]:8.2f} ms", flush=True)


def table(sizes: list[int], columns: dict[str, Rates]) -> str:
    raw = columns["raw ucxx"]
    names = list(columns)
    lines = ["| size | " + " | ".join(f"{n} GB/s (ms, x raw ucxx)" for n in names) + " |",
             "|---:|" + "---:|" * len(names)]
    for size in sizes:
        cells = []
        for name in names:
            rate, ms = columns[name][size]
            cells.append(f"{rate:.2f} ({ms:.1f}, {rate / raw[size][0]:.2f}x)")
        lines.append(f"| {size} MiB | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rate_chart(sizes: list[int], columns: dict[str, Rates]) -> str:
    """results/handoff_bandwidth.png: GB/s of every method by size, and the handoff's ratios
    to raw UCXX (target 0.5x) and to the Ray object store (target 3x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from _common import save_figure  # run as a script: benchmarks/ is on sys.path

    panels = [("raw ucxx", 0.5), ("ray", 3.0)]
    panels = [(base, target) for base, target in panels if base in columns]
    fig, axes = plt.subplots(1, 1 + len(panels), figsize=(5 * (1 + len(panels)), 4))
    for index, (name, column) in enumerate(columns.items()):
        style = dict(linestyle="-" if name.startswith("handoff") else "--", marker="o",
                     color=f"C{index}", label=name)
        axes[0].plot(sizes, [column[s][0] for s in sizes], **style)
        for ax, (base, _) in zip(axes[1:], panels, strict=True):
            if name.startswith("handoff"):
                ax.plot(sizes, [column[s][0] / columns[base][s][0] for s in sizes], **style)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("GB/s (log)")
    for ax, (base, target) in zip(axes[1:], panels, strict=True):
        ax.axhline(target, color="grey", linewidth=0.8, linestyle=":", label=f"target {target}x")
        ax.set_ylabel(f"handoff / {base} in the same run")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("payload (MiB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    path = save_figure(fig, "handoff_bandwidth",
                       f"KV handoff, two processes on {os.cpu_count()} CPUs (median per size)")
    return str(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,4,16,64,256", help="payload sizes in MiB")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray object store")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"KV-shaped payloads: {NUM_LAYERS} layers x N blocks of 32 KiB per layer (fp16); "
          f"{os.cpu_count()} CPUs; median of {args.reps} runs", flush=True)
    steps: list[tuple[str, Callable[[], dict[str, Rates]]]] = [
        ("memcpy", lambda: {"memcpy": measure_memcpy(sizes, args.reps)}),
        ("handoff and raw ucxx", lambda: measure_pair(sizes, args.reps)),
        ("tcp", lambda: {"tcp": measure_tcp(sizes, args.reps)}),
    ]
    if not args.no_ray:
        steps.append(("ray", lambda: {"ray": measure_ray(sizes, args.reps)}))
    columns: dict[str, Rates] = {}
    for name, run in steps:
        print(f"[{name}]", flush=True)
        columns.update(run())
    print()
    print(table(sizes, columns))
    for kind in ("scattered", "runs"):
        for base in ("raw ucxx", "ray"):
            if base in columns:
                ratios = [columns[f"handoff {kind}"][s][0] / columns[base][s][0] for s in sizes]
                print(f"handoff ({kind}) / {base}: "
                      + ", ".join(f"{s} MiB {r:.2f}x" for s, r in zip(sizes, ratios, strict=True)))
    from _common import save_json

    print("wrote", save_json("handoff_bandwidth", {
        "sizes_mib": sizes, "reps": args.reps,
        "gb_per_s": {name: {str(s): col[s][0] for s in sizes} for name, col in columns.items()},
        "ms": {name: {str(s): col[s][1] for s in sizes} for name, col in columns.items()}}))
    print("wrote", rate_chart(sizes, columns))


if __name__ == "__main__":
    main()
