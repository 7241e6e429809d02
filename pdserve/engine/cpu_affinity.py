"""Pinning a worker process to its own CPU cores, with torch's thread count to match.

Replicas of one role share their settings, so each claims one of the role's core sets at
start-up: an exclusive ``flock`` on that set's claim file, held while the process lives. The
kernel drops the lock when the process dies, so a dead replica's set is free for the next one
without any clean-up, and two replicas starting at once can never take the same set. A claim
also takes the set's lease (``cpu_lending``): held, the cores are not lent to other workers.

``sched_setaffinity`` binds one thread on Linux, so every thread of the process is bound
(from /proc/self/task); threads started later (the engine thread, torch's OpenMP pool, UCX)
inherit the binding from the thread that starts them.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

CLAIM_POLL_S = 0.1


class CpuAffinityError(RuntimeError):
    """A core set cannot be claimed or applied; the message says which and why."""


def parse_cpu_list(text: str | int) -> frozenset[int]:
    """A Linux cpulist (``"0-3,8"``, ``"5"`` or ``5``) as a set of core ids."""
    if isinstance(text, int) and not isinstance(text, bool):
        text = str(text)
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"core set {text!r} must be a cpulist such as '0', '2-3' or '0,4'")
    cores: set[int] = set()
    for part in text.split(","):
        low, sep, high = part.strip().partition("-")
        try:
            first, last = int(low), int(high) if sep else int(low)
        except ValueError:
            raise ValueError(f"core set {text!r}: {part.strip()!r} is not a core id or a "
                             "range like '2-3'") from None
        if first < 0 or last < first:
            raise ValueError(f"core set {text!r}: range {part.strip()!r} must run upwards "
                             "from core 0 or more")
        cores.update(range(first, last + 1))
    return frozenset(cores)


def format_cpu_list(cores: frozenset[int] | set[int]) -> str:
    """``{0, 1, 2, 5}`` -> ``"0-2,5"`` (how /proc writes Cpus_allowed_list)."""
    runs: list[list[int]] = []
    for core in sorted(cores):
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


@dataclass(frozen=True)
class CpuAffinity:
    """Core sets per role (replica k of a role claims one free set) and where claims live.

    ``claim_dir`` is made per application start, so replicas of one application compete
    only with each other.
    """

    core_sets: tuple[tuple[str, tuple[frozenset[int], ...]], ...]
    claim_dir: str
    claim_timeout_s: float = 60.0

    def sets_for(self, role: str) -> tuple[frozenset[int], ...]:
        return next((sets for name, sets in self.core_sets if name == role), ())


@dataclass(frozen=True)
class CpuClaim:
    """A claimed core set; the claim lasts while ``fd`` stays open (the process lives), and
    its cores are not lent while ``lease_fd`` holds the set's lease."""

    role: str
    index: int
    cores: frozenset[int]
    fd: int
    lease_fd: int

    def release(self) -> None:
        os.close(self.lease_fd)
        os.close(self.fd)


def set_file(root: Path, role: str, index: int, kind: str) -> Path:
    """A core set's lock file: ``claim`` (who owns it), ``lease`` and ``want`` (lending)."""
    return root / f"{role}-{index}.{kind}"


def open_set_file(root: Path, role: str, index: int, kind: str) -> int:
    """``set_file`` opened (made if missing) for ``flock``."""
    return os.open(set_file(root, role, index, kind), os.O_RDWR | os.O_CREAT, 0o600)


def claim_core_set(affinity: CpuAffinity, role: str) -> CpuClaim:
    """Take the first free core set of ``role``, waiting (bounded) while all are held."""
    sets = affinity.sets_for(role)
    if not sets:
        raise CpuAffinityError(f"engine.cpu_affinity lists no core set for the {role} role")
    root = Path(affinity.claim_dir)
    root.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + affinity.claim_timeout_s
    while True:
        for index, cores in enumerate(sets):
            fd = open_set_file(root, role, index, "claim")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())  # who holds it, for the error below
            # A worker borrowing these cores gives them back when its step ends.
            lease = open_set_file(root, role, index, "lease")
            fcntl.flock(lease, fcntl.LOCK_EX)
            return CpuClaim(role, index, cores, fd, lease)
        if time.monotonic() > deadline:
            holders = ", ".join(f"{format_cpu_list(c)} (pid {_holder(root, role, i)})"
                                for i, c in enumerate(sets))
            raise CpuAffinityError(
                f"every {role} core set is held by a live replica after "
                f"{affinity.claim_timeout_s:.0f}s: {holders}; give engine.cpu_affinity.{role} "
                "at least one set per replica")
        time.sleep(CLAIM_POLL_S)


def _holder(root: Path, role: str, index: int) -> str:
    try:
        return set_file(root, role, index, "claim").read_text().strip() or "?"
    except OSError:
        return "?"


def pin_process(cores: frozenset[int]) -> None:
    """Bind every thread of this process to ``cores`` (until no unbound thread is left)."""
    if not hasattr(os, "sched_setaffinity"):
        raise CpuAffinityError("engine.cpu_affinity needs Linux (os.sched_setaffinity)")
    pinned: set[int] = set()
    while True:
        threads = {int(tid) for tid in os.listdir("/proc/self/task")} - pinned
        if not threads:
            return
        for tid in threads:
            try:
                os.sched_setaffinity(tid, cores)
            except ProcessLookupError:
                pass  # the thread ended meanwhile
            except OSError as exc:
                raise CpuAffinityError(f"cannot pin to cores {format_cpu_list(cores)}: "
                                       f"{exc.strerror} (does this machine have them?)") from exc
            pinned.add(tid)


def apply_cpu_settings(affinity: CpuAffinity | None, num_threads: int | None,
                       role: str) -> CpuClaim | None:
    """Claim and apply this worker's core set (if its role has any) and torch's thread count
    (``num_threads``, else the claimed set's size); call before the engine starts threads."""
    claim = None
    if affinity is not None and affinity.sets_for(role):
        claim = claim_core_set(affinity, role)
        pin_process(claim.cores)
    threads = num_threads or (len(claim.cores) if claim is not None else None)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    if claim is not None or threads is not None:
        logger.info("%s worker (pid %d): cores %s, %s torch threads", role, os.getpid(),
                    format_cpu_list(claim.cores) if claim else "unpinned", threads)
    return claim
