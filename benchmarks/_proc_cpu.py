"""CPU time of a served run's processes and their threads, read from /proc (Linux).

Snapshots before and after a workload give each process's and each named thread's CPU seconds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

TICKS_PER_S = os.sysconf("SC_CLK_TCK")
ENGINE_THREAD = "pdserve-engine"  # the OS name of every worker's engine thread


@dataclass(frozen=True)
class ProcessCPU:
    """One process's CPU seconds (utime + stime), whole and per thread name (summed)."""

    title: str
    total_s: float
    by_thread_s: dict[str, float] = field(default_factory=dict)


def _ticks(stat_path: Path) -> tuple[str, float] | None:
    try:
        stat = stat_path.read_text()
    except OSError:
        return None
    name = stat[stat.index("(") + 1:stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2:].split()
    return name, (int(fields[11]) + int(fields[12])) / TICKS_PER_S  # utime, stime


def _title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def session_pids(session_id: int) -> list[int]:
    """Every living process of session ``session_id``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2:].split()[3]) == session_id:
            found.append(int(entry))
    return found


def snapshot(pids: list[int]) -> dict[int, ProcessCPU]:
    out: dict[int, ProcessCPU] = {}
    for pid in pids:
        whole = _ticks(Path(f"/proc/{pid}/stat"))
        if whole is None:
            continue
        threads: dict[str, float] = {}
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            tids = []
        for tid in tids:
            got = _ticks(Path(f"/proc/{pid}/task/{tid}/stat"))
            if got is not None:
                threads[got[0]] = threads.get(got[0], 0.0) + got[1]
        out[pid] = ProcessCPU(_title(pid), whole[1], threads)
    return out


def role_of(title: str) -> str | None:
    """ingress / decode / prefill / proxy for a Serve process's title, else None."""
    for role in ("ingress", "decode", "prefill"):
        if title.startswith("ray::ServeReplica:") and title.split(" ")[0].endswith(f":{role}"):
            return role
    if title.startswith("ray::ProxyActor"):
        return "proxy"
    return None


def role_cpu(before: dict[int, ProcessCPU], after: dict[int, ProcessCPU]
             ) -> dict[str, float]:
    """CPU seconds spent between the snapshots per role, plus ``<role>.engine`` for the
    engine thread of each worker role (processes of one role summed)."""
    spent: dict[str, float] = {}
    for pid, end in after.items():
        role = role_of(end.title)
        start = before.get(pid)
        if role is None or start is None:
            continue
        spent[role] = spent.get(role, 0.0) + end.total_s - start.total_s
        engine = end.by_thread_s.get(ENGINE_THREAD, 0.0) - start.by_thread_s.get(
            ENGINE_THREAD, 0.0)
        if role in ("decode", "prefill"):
            spent[f"{role}.engine"] = spent.get(f"{role}.engine", 0.0) + engine
    return spent
