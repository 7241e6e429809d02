"""The child side of the CPU-claim and lending tests: claims core sets and reports what it
saw (torch is imported only by the lending scenario, so claim children start in a blink)."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import signal
from pathlib import Path

from pdserve.engine.cpu_affinity import CpuAffinity, claim_core_set, parse_cpu_list, set_file


def affinity(claim_dir: Path, *sets: str, timeout_s: float = 60.0) -> CpuAffinity:
    return CpuAffinity((("decode", tuple(parse_cpu_list(s) for s in sets)),), str(claim_dir),
                       timeout_s)


def claim_and_hold(claim_dir: str, sets: list[str], out: multiprocessing.Queue) -> None:
    """Claim a decode set, report (pid, set index), then wait to be killed."""
    claim = claim_core_set(affinity(Path(claim_dir), *sets), "decode")
    out.put((os.getpid(), claim.index))
    signal.pause()


def lend_and_borrow(claim_dir: str, sets: list[str], out: multiprocessing.Queue) -> None:
    """Two workers' lending in one process (flock locks belong to open files, so two sets of
    files conflict as two processes' would): B steps while A is busy, then while A is idle,
    and A takes its cores back in the middle of B's borrowed step. Reports what each saw."""
    import threading

    import torch

    from pdserve.engine.cpu_lending import MIN_LENT_TOKENS, CoreLending
    from pdserve.engine.threads import name_native_thread

    torch.set_num_threads(1)
    aff = affinity(Path(claim_dir), *sets)
    a_claim, b_claim = claim_core_set(aff, "decode"), claim_core_set(aff, "decode")
    a, b = CoreLending(aff, a_claim), CoreLending(aff, b_claim)
    seen: dict[str, object] = {"a": sorted(a.cores), "b": sorted(b.cores)}

    def a_wants_back() -> None:
        name_native_thread("lender")  # not one of B's pool workers
        a.busy()
        seen["a_back_lent_steps"] = b.lent_steps  # B's borrowed step had ended

    def engine() -> None:
        name_native_thread("pdserve-engine")
        os.sched_setaffinity(0, b.cores)
        with b.step(64):  # A holds its lease since its claim
            seen["threads_while_a_busy"] = torch.get_num_threads()
        a.idle()
        with b.step(MIN_LENT_TOKENS - 1):  # too small to gain from another thread
            seen["threads_small_step"] = torch.get_num_threads()
        with b.step(MIN_LENT_TOKENS):
            seen["threads_lent"] = torch.get_num_threads()
            seen["engine_cores_lent"] = sorted(os.sched_getaffinity(0))
            torch.ones(256, 256) @ torch.ones(256, 256)  # starts the OpenMP pool
            taker = threading.Thread(target=a_wants_back)
            taker.start()
            want = os.open(set_file(Path(claim_dir), "decode", a_claim.index, "want"), os.O_RDWR)
            while not _held(want):  # until A says it wants its cores back
                pass
            seen["a_waits_for_the_step"] = taker.is_alive()
            seen["lendable_while_wanted"] = b._borrow(b._others[0])
        taker.join(30)
        seen["a_back"] = not taker.is_alive()
        seen["threads_after"] = torch.get_num_threads()
        seen["engine_cores_after"] = sorted(os.sched_getaffinity(0))
        seen["workers"] = {tid: sorted(os.sched_getaffinity(tid)) for tid in b._workers}
        with b.step(64):  # A is busy again
            seen["threads_after_a_back"] = torch.get_num_threads()
        seen["lent_steps"] = b.lent_steps

    thread = threading.Thread(target=engine)
    thread.start()
    thread.join()
    out.put(seen)


def _held(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False
