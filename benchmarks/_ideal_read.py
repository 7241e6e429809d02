"""The same-host read with pdserve's kernels and none of its protocol: what this machine allows.

Two spawned processes share a cache through ``multiprocessing.shared_memory``. The pieces
are pdserve's slot plan (`plan_pieces` from ``SLOT_MIN_PIECE_BYTES``). After each layer the
sender hashes the pieces that layer completes in place (`digest_rows`, as pdserve's compute
thread does), stores their digests and rings a futex bell; the receiver wakes, and its two
threads copy and hash each piece (`read_piece`, as pdserve's read threads do) and compare.
No UCX, no session, no frames, no records, no checks: pdserve's read path minus everything
that makes it a protocol, so ``pdserve / ideal`` is the cost of that protocol here.
"""

from __future__ import annotations

import concurrent.futures
import random
import time
from multiprocessing import shared_memory
from typing import Any

import numpy as np

_WAIT_S = 0.05  # futex wait bound; the loop re-checks the bell word after each
_MAX_PIECES = 1024


def _attach(name: str, shape: tuple[int, ...], dtype: str) -> tuple[Any, np.ndarray]:
    memory = shared_memory.SharedMemory(name=name)
    return memory, np.ndarray(shape, dtype=dtype, buffer=memory.buf)


def ideal_worker(conn: Any, role: str, cache_name: str, bell_name: str,
                 shape: tuple[int, ...], layout: Any, max_piece_bytes: int) -> None:
    """One role, driven by (op, args) over ``conn``: "read"/"write" with (src ids, dst ids)."""
    from pdserve.handoff.futex import futex_wait, futex_wake
    from pdserve.handoff.kvcopy import digest_rows, joint_runs, read_piece
    from pdserve.handoff.piece_plan import SLOT_MIN_PIECE_BYTES, plan_pieces

    cache_mem, src = _attach(cache_name, shape, "uint8")
    bell_mem, words = _attach(bell_name, (1 + _MAX_PIECES,), "<u8")
    bell = words[:1].view("<u4")
    bell_address = words.ctypes.data
    dst = np.ones(shape, dtype=np.uint8) if role == "receiver" else None
    pool = concurrent.futures.ThreadPoolExecutor(2) if role == "receiver" else None
    conn.send("up")
    while True:
        op, args = conn.recv()
        if op == "stop":
            break
        src_ids, dst_ids = (np.asarray(ids, dtype=np.int64) for ids in args)
        specs = plan_pieces(layout, len(src_ids), SLOT_MIN_PIECE_BYTES, max_piece_bytes)
        if op == "write":
            started = time.monotonic()
            runs = joint_runs(src_ids)
            for layer in range(layout.num_local_layers):  # the engine's per-layer hook
                for spec in specs:
                    if spec.layer_end == layer + 1:  # pieces go in layer order
                        words[1 + spec.index] = digest_rows(src, src_ids, spec, runs)
                        bell[0] = spec.index + 1
                        futex_wake(bell_address)
            conn.send(started)
            continue
        assert pool is not None and dst is not None
        conn.send("armed")
        runs = joint_runs(src_ids, dst_ids)
        jobs, seen = [], 0
        while seen < len(specs):
            published = int(bell[0])
            if published == seen:
                futex_wait(bell_address, seen, _WAIT_S)
                continue
            jobs += [pool.submit(read_piece, src, src_ids, dst, dst_ids, spec, runs)
                     for spec in specs[seen:published]]
            seen = published
        ok = all(job.result() == int(words[1 + i]) for i, job in enumerate(jobs))
        conn.send((time.monotonic(), ok))
    if pool is not None:
        pool.shutdown()
    del src, words, bell
    cache_mem.close()
    bell_mem.close()


def measure_ideal(layout: Any, max_piece_bytes: int, sizes: list[int], reps: int,
                  contiguous: bool, num_cache_blocks: int) -> dict[int, list[float]]:
    """Seconds per run (after one warm-up) for each size, block ids chosen like the handoff's
    (``layout``: the benchmark's `KVLayout`; ``max_piece_bytes``: its handoff config's)."""
    from _common import role_pair, transfer_block_ids

    shape = (layout.num_local_layers, 2, num_cache_blocks, layout.block_bytes // 2)
    cache = shared_memory.SharedMemory(create=True, size=int(np.prod(shape)))
    bell = shared_memory.SharedMemory(create=True, size=8 * (1 + _MAX_PIECES))
    try:
        np.ndarray(shape, np.uint8, cache.buf)[:] = np.random.randint(0, 255, shape, np.uint8)
        rng = random.Random(0)
        timings: dict[int, list[float]] = {}
        roles = (cache.name, bell.name, shape, layout, max_piece_bytes)
        with role_pair(ideal_worker, roles) as (receiver, sender):
            for size in sizes:
                timings[size] = []
                for rep in range(reps + 1):
                    src, dst = transfer_block_ids(rng, size, num_cache_blocks, contiguous)
                    np.ndarray((1,), "<u8", bell.buf)[0] = 0
                    receiver.send(("read", (src, dst)))
                    assert receiver.recv() == "armed"
                    sender.send(("write", (src, dst)))
                    started = sender.recv()
                    finished, ok = receiver.recv()
                    if not ok:
                        raise RuntimeError(f"ideal read of {size} MiB: a digest differed")
                    if rep:
                        timings[size].append(finished - started)
        return timings
    finally:
        for memory in (cache, bell):
            memory.close()
            memory.unlink()
