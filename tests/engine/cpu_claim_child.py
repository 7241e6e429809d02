"""The child side of the CPU-claim tests: claims a core set and reports it (imports no torch,
so spawned children start in a blink)."""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path

from pdserve.engine.cpu_affinity import CpuAffinity, claim_core_set, parse_cpu_list


def affinity(claim_dir: Path, *sets: str, timeout_s: float = 60.0) -> CpuAffinity:
    return CpuAffinity((("decode", tuple(parse_cpu_list(s) for s in sets)),), str(claim_dir),
                       timeout_s)


def claim_and_hold(claim_dir: str, sets: list[str], out: multiprocessing.Queue) -> None:
    """Claim a decode set, report (pid, set index), then wait to be killed."""
    claim = claim_core_set(affinity(Path(claim_dir), *sets), "decode")
    out.put((os.getpid(), claim.index))
    signal.pause()
