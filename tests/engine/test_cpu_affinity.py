"""CPU pinning: cpulists, race-free core-set claims that free themselves when their process
dies, and binding that reaches every thread, later ones (engine thread, torch's OpenMP pool)
included. Pinning runs in child processes, never in the test process itself."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

from pdserve.engine.cpu_affinity import (
    CpuAffinityError,
    apply_cpu_settings,
    claim_core_set,
    format_cpu_list,
    parse_cpu_list,
)
from tests.engine.cpu_claim_child import affinity, claim_and_hold

CTX = multiprocessing.get_context("spawn")
CORES = sorted(os.sched_getaffinity(0))


def test_cpulists_parse_and_print_like_proc() -> None:
    assert parse_cpu_list("0-2,5") == {0, 1, 2, 5} and parse_cpu_list(3) == {3}
    assert format_cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    for bad in ("", "a", "3-1", "-1", "1,,2"):
        with pytest.raises(ValueError, match="core set"):
            parse_cpu_list(bad)


def test_claims_take_distinct_sets_and_a_full_role_waits_then_fails(tmp_path: Path) -> None:
    aff = affinity(tmp_path, "0", "1", timeout_s=0.3)
    first, second = claim_core_set(aff, "decode"), claim_core_set(aff, "decode")
    assert {first.index, second.index} == {0, 1}
    held = rf"every decode core set is held.*pid {os.getpid()}"
    with pytest.raises(CpuAffinityError, match=held):
        claim_core_set(aff, "decode")
    second.release()
    assert claim_core_set(aff, "decode").index == second.index


def test_a_killed_holders_set_is_free_again(tmp_path: Path) -> None:
    out = CTX.Queue()
    holder = CTX.Process(target=claim_and_hold, args=(str(tmp_path), ["0"], out))
    holder.start()
    try:
        assert out.get(timeout=60)[1] == 0
        with pytest.raises(CpuAffinityError, match=f"pid {holder.pid}"):
            claim_core_set(affinity(tmp_path, "0", timeout_s=0.2), "decode")
    finally:
        holder.kill()
        holder.join(30)
    assert claim_core_set(affinity(tmp_path, "0", timeout_s=5), "decode").index == 0


def test_replicas_starting_at_once_never_share_a_set(tmp_path: Path) -> None:
    out = CTX.Queue()
    sets = [str(k) for k in range(6)]
    procs = [CTX.Process(target=claim_and_hold, args=(str(tmp_path), sets, out))
             for _ in range(6)]
    for p in procs:
        p.start()
    try:
        claimed = [out.get(timeout=120)[1] for _ in procs]
    finally:
        for p in procs:
            p.kill()
            p.join(30)
    assert sorted(claimed) == list(range(6))


def _pin_and_report(claim_dir: str, core: int, out: multiprocessing.Queue) -> None:
    import threading

    import torch

    before = threading.Event()
    early = threading.Thread(target=before.wait, daemon=True)  # exists before pinning
    early.start()
    claim = apply_cpu_settings(affinity(Path(claim_dir), str(core)), 2, "decode")
    seen: dict[str, object] = {}

    def engine_like() -> None:  # a thread started after pinning runs torch's parallel ops
        seen["before"] = len(os.listdir("/proc/self/task"))
        torch.ones(512, 512) @ torch.ones(512, 512)
        seen["threads"] = torch.get_num_threads()
        seen["own"] = sorted(os.sched_getaffinity(0))
        # While this thread lives, so does the OpenMP team its parallel op started.
        seen["allowed"] = {tid: _allowed(Path("/proc/self/task") / tid / "status")
                           for tid in os.listdir("/proc/self/task")}

    worker = threading.Thread(target=engine_like)
    worker.start()
    worker.join()
    out.put((claim.cores if claim else None, seen))
    before.set()


def _allowed(status: Path) -> str:
    line = next(x for x in status.read_text().splitlines() if x.startswith("Cpus_allowed_list"))
    return line.split(":", 1)[1].strip()


@pytest.mark.skipif(len(CORES) < 2, reason="pinning to one core of several needs 2+ cores")
def test_every_thread_ends_on_the_claimed_cores(tmp_path: Path) -> None:
    core = CORES[-1]
    out = CTX.Queue()
    child = CTX.Process(target=_pin_and_report, args=(str(tmp_path), core, out))
    child.start()
    cores, seen = out.get(timeout=120)
    child.join(30)
    assert cores == {core}
    assert (seen["threads"], seen["own"]) == (2, [core])
    # Threads from before the pinning, the new thread, and the OpenMP thread its op started.
    allowed = seen["allowed"]
    assert len(allowed) > seen["before"], "no OpenMP thread appeared"
    assert set(allowed.values()) == {str(core)}


def test_num_threads_alone_sets_torch_threads_without_pinning() -> None:
    out = CTX.Queue()
    child = CTX.Process(target=_threads_only, args=(out,))
    child.start()
    assert out.get(timeout=120) == (None, 1, CORES)
    child.join(30)


def _threads_only(out: multiprocessing.Queue) -> None:
    import torch

    claim = apply_cpu_settings(None, 1, "decode")
    out.put((claim, torch.get_num_threads(), sorted(os.sched_getaffinity(0))))
