"""Idle pinned workers lend their cores: a step borrows the core sets (``cpu_affinity``) whose
workers have nothing to run, as more torch threads, and gives them back when it ends.

Each core set has a lease and a want file next to its claim. The set's worker holds the lease
(exclusive ``flock``) while it has work and drops it when idle; a worker about to run a step
takes, without waiting, the leases of sets that are neither held nor wanted, runs the step on
its own cores and those, and drops them. A worker that gets work while its cores are lent
first takes its want lock, so no borrower takes them again, then waits for the lease: one
borrowed step at most. The kernel drops every lock of a process that dies.

Threads: the engine thread stays on its own cores; the OpenMP workers it starts (torch's and
the decode kernel's pools) run on the borrowed cores. Pools grow on first use, so new workers
are found after each borrowed step (threads the engine thread started: they carry its name).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.engine.cpu_affinity import CpuAffinity, CpuClaim, format_cpu_list, open_set_file

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.engine_config import EngineConfig

logger = logging.getLogger(__name__)
TASKS = Path("/proc/self/task")
# Only steps that compute prompt tokens borrow, and only MIN..MAX of them (medium checkpoint,
# float32, 2-core EPYC): a 112-token prefill took 59-95 ms with a lent core against 86-117
# without, while a one-row decode step gained nothing (12.3-13.9 ms against 12.3-13.2) and
# 32/64 streams decoding on two replicas lost 7 and 11 % of their throughput with decode
# steps lent.
MIN_LENT_TOKENS = 16
# A lender that gets work waits for the step: a 512-token prefill takes 0.21-0.26 s there
# on two threads, a whole-batch one of ~1,800 tokens ~0.9 s.
MAX_LENT_TOKENS = 512


@dataclass(frozen=True)
class LendableSet:
    """Another worker's core set, with its lock files open here."""

    cores: frozenset[int]
    lease_fd: int
    want_fd: int


def _try_lock(fd: int, mode: int) -> bool:
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


class CoreLending:
    """One pinned worker's side of lending; every method runs on its engine thread."""

    def __init__(self, affinity: CpuAffinity, claim: CpuClaim) -> None:
        import torch

        root = Path(affinity.claim_dir)
        self.cores = claim.cores
        self._lease_fd = claim.lease_fd
        self._want_fd = open_set_file(root, claim.role, claim.index, "want")
        self._holding = True  # the claim took the lease
        self._others = [
            LendableSet(cores, open_set_file(root, role, index, "lease"),
                        open_set_file(root, role, index, "want"))
            for role, sets in affinity.core_sets for index, cores in enumerate(sets)
            if (role, index) != (claim.role, claim.index) and cores.isdisjoint(claim.cores)]
        self._threads = torch.get_num_threads()
        self._workers: set[int] = set()
        self._engine_name: str | None = None  # the engine thread's, which its pools inherit
        self.lent_steps = 0  # steps that ran with borrowed cores

    def idle(self) -> None:
        """Nothing to run: other workers may borrow these cores."""
        if self._holding:
            fcntl.flock(self._lease_fd, fcntl.LOCK_UN)
            self._holding = False

    def busy(self) -> None:
        """Work to run: take the cores back (waiting for a borrower's step to end)."""
        if not self._holding:
            fcntl.flock(self._want_fd, fcntl.LOCK_EX)  # no borrower takes them from now on
            try:
                fcntl.flock(self._lease_fd, fcntl.LOCK_EX)
            finally:
                fcntl.flock(self._want_fd, fcntl.LOCK_UN)
            self._holding = True

    @contextmanager
    def step(self, prompt_tokens: int) -> Iterator[None]:
        """Run one step's compute (its worker ``busy``) on this worker's cores and, if it
        computes enough prompt tokens to gain from more threads and few enough that a lender
        wanting its cores back waits little, every idle set it can take."""
        taken = [s for s in self._others if self._borrow(s)] \
            if MIN_LENT_TOKENS <= prompt_tokens <= MAX_LENT_TOKENS else []
        if not taken:
            yield
            return
        import torch

        borrowed = frozenset().union(*(s.cores for s in taken))
        if self._engine_name is None:
            self._engine_name = _comm(str(threading.get_native_id()))
        before = set(os.listdir(TASKS))
        try:
            self._pin(self._workers, borrowed)
            torch.set_num_threads(self._threads + len(borrowed))
            yield
        finally:
            torch.set_num_threads(self._threads)
            self._adopt(before, borrowed)
            self.lent_steps += 1
            for lent in taken:
                fcntl.flock(lent.lease_fd, fcntl.LOCK_UN)

    def close(self) -> None:
        for lent in self._others:
            os.close(lent.lease_fd)
            os.close(lent.want_fd)
        os.close(self._want_fd)

    @staticmethod
    def _borrow(lent: LendableSet) -> bool:
        """Take an idle set's lease unless its worker wants it back."""
        if not _try_lock(lent.want_fd, fcntl.LOCK_SH):
            return False
        fcntl.flock(lent.want_fd, fcntl.LOCK_UN)
        return _try_lock(lent.lease_fd, fcntl.LOCK_EX)

    def _adopt(self, before: set[str], borrowed: frozenset[int]) -> None:
        """Threads the engine thread started during the step (pool workers) join the workers
        that run on borrowed cores."""
        new = {int(tid) for tid in set(os.listdir(TASKS)) - before
               if _comm(tid) == self._engine_name}
        if new:
            logger.debug("OpenMP workers %s run on lent cores %s", sorted(new),
                         format_cpu_list(borrowed))
            self._pin(new, borrowed)
            self._workers |= new

    def _pin(self, tids: set[int], cores: frozenset[int]) -> None:
        for tid in list(tids):
            try:
                os.sched_setaffinity(tid, cores)
            except ProcessLookupError:
                tids.discard(tid)  # the pool shrank


def lending(config: EngineConfig, claim: CpuClaim | None, engine: LLMEngine
            ) -> CoreLending | None:
    """Lending for a pinned one-rank CPU worker whose config allows it (a tensor-parallel
    replica's ranks step in lockstep across processes: they keep their cores)."""
    if (not config.cpu_lending or config.cpu_affinity is None or claim is None
            or engine.tp.size != 1 or engine.device.type != "cpu"):
        return None
    return CoreLending(config.cpu_affinity, claim)


def _comm(tid: str) -> str | None:
    try:
        return (TASKS / tid / "comm").read_text().strip()
    except OSError:
        return None
