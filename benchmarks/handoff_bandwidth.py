"""KV handoff bandwidth: pdserve's UCXX handoff vs in-process memcpy vs the Ray object store
between two Ray nodes vs a plain TCP socket, for KV-shaped payloads of 1 to 256 MiB.

Run: ``python benchmarks/handoff_bandwidth.py [--sizes 1,4,16,64,256] [--reps 5] [--no-ray]``
Writes ``results/handoff_bandwidth.json`` and ``.png`` (GB/s and ratio to memcpy by size).

Every number is the median over ``--reps`` runs after one warm-up, on one machine:
- handoff: two spawned processes; from the first per-layer hook call on the sender to the
  receiver's ready future resolving (digests, transfer, digest checks and fence included),
  with block ids scattered at random on both sides ("scattered") and with each side's blocks
  in one run ("runs"). "read": the sender's cache is in UCX shared memory and exported, and
  the receiver copies each piece from it itself (the prefill worker's default on one host);
  "push": an ordinary sender cache, pieces sent over UCX (staged when scattered; direct once
  a layer's K or V reaches ``direct_min_piece_bytes``, i.e. from 32 blocks = 32 MiB here).
- memcpy: ``np.copyto`` of the same number of bytes in this process (the ceiling).
- ideal read: the read's kernels (in-place digest per layer, a futex bell, two threads
  copying and hashing) between two processes with no protocol at all (`_ideal_read`): what
  this machine allows a verified same-host read; "read / ideal" is pdserve's overhead.
- tcp: two processes, ``sendall``/``recv_into`` over 127.0.0.1, first byte sent to last byte in.
- ray: two Ray nodes started here (``ray.cluster_utils.Cluster``: separate raylets and object
  stores, its own temp dir, shut down by its own pids); ``ray.put`` in an actor pinned to one
  node plus ``ray.get`` in an actor pinned to the other (both timed inside the actors).
"""

from __future__ import annotations

import argparse
import functools
import logging
import multiprocessing
import os
import random
import shutil
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

MIB = 1 << 20
NUM_LAYERS = 32
Rates = dict[int, tuple[float, float]]  # size in MiB -> (GB/s, ms)
BENCH_CONFIG: dict[str, Any] = {
    "auth_token": "bench-secret", "receiver_staging_bytes": 512 * MIB,
    "sender_staging_bytes": 512 * MIB, "max_piece_bytes": 16 * MIB, "min_piece_bytes": 8 * MIB,
    "default_timeout_s": 60.0,
}


def bench_layout() -> Any:
    """A Llama-like KV slice: 32 layers x 8 KV heads x 64 dims, fp16, 16-token blocks, so one
    block across all layers is exactly 1 MiB and an N MiB payload is N blocks."""
    from pdserve.engine.kv_layout import KVLayout

    return KVLayout("bench", "float16", block_size=16, num_layers=NUM_LAYERS, num_kv_heads=8,
                    head_dim=64)


# ---- child processes ------------------------------------------------------------------------
def handoff_worker(conn: Any, role: str, num_cache_blocks: int, reads: bool) -> None:
    """One handoff role in its own process, driven by (op, args) tuples over a pipe.
    ``reads``: the sender's cache is in shared memory and exported, so the receiver (same
    host) reads the KV itself; otherwise the sender pushes it over UCX."""
    import torch

    from pdserve.handoff import (
        HandoffConfig,
        HandoffReceiver,
        HandoffSender,
        HandoffTicket,
        HandoffTransport,
    )

    layout = bench_layout()
    cache = torch.randn(layout.cache_shape(num_cache_blocks)).to(layout.torch_dtype)
    transport = HandoffTransport(HandoffConfig(**BENCH_CONFIG)).start()
    receiver = HandoffReceiver(transport, cache, layout) if role == "receiver" else None
    sender = HandoffSender(transport) if role == "sender" else None
    if sender is not None and reads:
        shared = transport.share_host_memory(cache.numel() * cache.element_size())
        cache = shared.view(cache.dtype).view(cache.shape).copy_(cache)
        if not sender.export_cache(cache):
            raise RuntimeError("the shared cache could not be exported")
    stamps: dict[str, float] = {}
    conn.send("up")
    while True:
        op, args = conn.recv()
        if op == "stop":
            transport.stop()
            conn.send("stopped")
            return
        if op == "reserve" and receiver is not None:
            request_id, block_ids = args
            ticket = receiver.reserve(request_id, block_ids, layout, len(block_ids) * 16)
            future = receiver.ready_future(request_id)
            future.add_done_callback(_stamper(stamps, request_id))
            conn.send(ticket.to_dict())
        elif op == "wait" and receiver is not None:
            info = receiver.wait_ready(args, timeout=60)
            conn.send((stamps[args], info.num_bytes))
        elif op == "push" and sender is not None:
            ticket, block_ids = args
            transfer = sender.start_transfer(HandoffTicket.from_dict(ticket), block_ids, layout)
            started = time.monotonic()
            for layer in range(layout.num_local_layers):  # the engine's per-layer hook
                sender.send_layer(cache, layer, [transfer])
            sender.send_fence(transfer, 1)
            result = transfer.released.result(60)
            conn.send((started, result.ok, str(result.error)))


def _stamper(stamps: dict[str, float], key: str) -> Callable[[object], None]:
    """Records when the ready future resolved, on the thread that resolved it."""
    def stamp(_: object) -> None:
        stamps[key] = time.monotonic()
    return stamp


def tcp_receiver(conn: Any, max_bytes: int) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    conn.send(server.getsockname()[1])
    peer, _ = server.accept()
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 * MIB)
    buffer = memoryview(bytearray(max_bytes))
    while True:
        nbytes = conn.recv()
        if nbytes == 0:
            return
        got = 0
        while got < nbytes:
            got += peer.recv_into(buffer[got:nbytes])
        conn.send(time.monotonic())


def tcp_sender(conn: Any, port: int, max_bytes: int) -> None:
    peer = socket.create_connection(("127.0.0.1", port))
    peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 * MIB)
    payload = memoryview(np.random.randint(0, 255, max_bytes, dtype=np.uint8).tobytes())
    while True:
        nbytes = conn.recv()
        if nbytes == 0:
            return
        started = time.monotonic()
        peer.sendall(payload[:nbytes])
        conn.send(started)


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


def measure_handoff(sizes: list[int], reps: int, contiguous: bool, reads: bool) -> Rates:
    from _common import role_pair, transfer_block_ids

    num_cache_blocks = max(sizes) + 8
    rng = random.Random(0)
    results = {}
    with role_pair(handoff_worker, (num_cache_blocks, reads)) as (receiver, sender):
        for size in sizes:
            timings = []
            for rep in range(reps + 1):
                src, dst = transfer_block_ids(rng, size, num_cache_blocks, contiguous)
                request_id = f"{size}-{rep}"
                receiver.send(("reserve", (request_id, dst)))
                sender.send(("push", (receiver.recv(), src)))
                receiver.send(("wait", request_id))
                ready_at, nbytes = receiver.recv()
                started, ok, error = sender.recv()
                if not ok:
                    raise RuntimeError(f"handoff of {size} MiB failed: {error}")
                assert nbytes == size * MIB
                if rep:  # the first run warms staging pools and links
                    timings.append(ready_at - started)
            results[size] = median_rate(size * MIB, timings)
            name = f"{'read' if reads else 'push'} {'runs' if contiguous else 'scattered'}"
            report(name, size, results[size])
    return results


def measure_ideal(sizes: list[int], reps: int, contiguous: bool) -> Rates:
    from _ideal_read import measure_ideal as run_ideal

    timings = run_ideal(bench_layout(), BENCH_CONFIG["max_piece_bytes"], sizes, reps, contiguous,
                        max(sizes) + 8)
    results = {size: median_rate(size * MIB, timings[size]) for size in sizes}
    for size in sizes:
        report(f"ideal read {'runs' if contiguous else 'scattered'}", size, results[size])
    return results


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
    memcpy = columns["memcpy"]
    names = list(columns)
    lines = ["| size | " + " | ".join(f"{n} GB/s (ms, x memcpy)" for n in names) + " |",
             "|---:|" + "---:|" * len(names)]
    for size in sizes:
        cells = []
        for name in names:
            rate, ms = columns[name][size]
            cells.append(f"{rate:.2f} ({ms:.1f}, {rate / memcpy[size][0]:.2f}x)")
        lines.append(f"| {size} MiB | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rate_chart(sizes: list[int], columns: dict[str, Rates]) -> str:
    """results/handoff_bandwidth.png: GB/s by size, and each method's ratio to memcpy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from _common import save_figure  # run as a script: benchmarks/ is on sys.path

    fig, (rates, ratios) = plt.subplots(1, 2, figsize=(11, 4))
    for index, (name, column) in enumerate(columns.items()):
        baseline = name in ("memcpy", "tcp", "ray") or name.startswith("ideal")
        style = dict(linestyle="--" if baseline else "-", marker="o",
                     color=f"C{index}", label=name)
        rates.plot(sizes, [column[s][0] for s in sizes], **style)
        if name != "memcpy":
            ratios.plot(sizes, [column[s][0] / columns["memcpy"][s][0] for s in sizes], **style)
    ratios.axhline(0.5, color="grey", linewidth=0.8, linestyle=":", label="target 0.5x")
    for ax, ylabel in ((rates, "GB/s"), (ratios, "x memcpy in the same run")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("payload (MiB)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    rates.legend(fontsize=8)
    ratios.legend(fontsize=8)
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
    # Each ideal read runs right after the read it bounds: this VM's speed drifts over minutes.
    steps: list[tuple[str, Callable[[], Rates]]] = [
        ("memcpy", lambda: measure_memcpy(sizes, args.reps)),
        *(step for kind in ("scattered", "runs") for step in (
            (f"read {kind}", functools.partial(measure_handoff, sizes, args.reps,
                                               contiguous=kind == "runs", reads=True)),
            (f"ideal read {kind}", functools.partial(measure_ideal, sizes, args.reps,
                                                     contiguous=kind == "runs")))),
        *((f"push {kind}", functools.partial(measure_handoff, sizes, args.reps,
                                             contiguous=kind == "runs", reads=False))
          for kind in ("scattered", "runs")),
        ("tcp", lambda: measure_tcp(sizes, args.reps)),
    ]
    if not args.no_ray:
        steps.append(("ray", lambda: measure_ray(sizes, args.reps)))
    measured = {}
    for name, run in steps:
        print(f"[{name}]", flush=True)
        measured[name] = run()
    order = ["memcpy", "read scattered", "read runs", "push scattered", "push runs",
             "ideal read scattered", "ideal read runs", "tcp", "ray"]
    columns = {name: measured[name] for name in order if name in measured}
    print()
    print(table(sizes, columns))
    for kind in ("scattered", "runs"):
        ratios = [columns[f"read {kind}"][s][0] / columns[f"ideal read {kind}"][s][0]
                  for s in sizes]
        print(f"handoff (read {kind}) / ideal read: "
              + ", ".join(f"{s} MiB {r:.2f}x" for s, r in zip(sizes, ratios, strict=True)))
    if "ray" in columns:
        for kind in ("read scattered", "read runs", "push scattered", "push runs"):
            ratios = [columns[kind][s][0] / columns["ray"][s][0] for s in sizes]
            print(f"handoff ({kind}) / ray object store: "
                  + ", ".join(f"{s} MiB {r:.1f}x" for s, r in zip(sizes, ratios, strict=True)))
    from _common import save_json

    print("wrote", save_json("handoff_bandwidth", {
        "sizes_mib": sizes, "reps": args.reps,
        "gb_per_s": {name: {str(s): col[s][0] for s in sizes} for name, col in columns.items()},
        "ms": {name: {str(s): col[s][1] for s in sizes} for name, col in columns.items()}}))
    print("wrote", rate_chart(sizes, columns))


if __name__ == "__main__":
    main()
