"""Processes a test started and the sockets they listen on, read from /proc (Linux), and
free ports from the OS.

Scoped by parentage or session, so a test never touches another agent's processes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tests.support.waiting import wait_for

_TCP_LISTEN = "0A"


def free_port() -> int:
    """A loopback port the OS says is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class ListeningSocket:
    pid: int
    title: str  # the process's command line (Ray workers show ray::<Class>:...)
    protocol: str  # tcp or udp
    host: str
    port: int


def _stat_fields(pid: int) -> list[str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()  # after the command name: state, ppid, pgrp, sid


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def descendants(root: int) -> list[int]:
    """Every living process below ``root`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for pid in _all_pids():
        fields = _stat_fields(pid)
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(pid)
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def in_sessions(session_ids: Iterable[int]) -> list[int]:
    """Every living process of these sessions (a process started with a new session and
    everything it spawned, daemons included), this one left out."""
    wanted = set(session_ids)
    return [pid for pid in _all_pids() if pid != os.getpid()
            and (fields := _stat_fields(pid)) is not None and int(fields[3]) in wanted]


def stop_sessions(session_ids: Iterable[int], grace_s: float = 3.0) -> None:
    """SIGTERM every process of the sessions, then SIGKILL what is left after ``grace_s``."""
    sessions = set(session_ids)
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for pid in in_sessions(sessions):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        try:
            wait_for(lambda: not in_sessions(sessions), wait_s, "the sessions' processes to exit",
                     interval_s=0.2)
            return
        except AssertionError:
            continue


def title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def _sockets(pid: int, protocol: str) -> dict[int, tuple[str, int, str]]:
    """inode -> (host, port, state) of ``pid``'s network namespace's ``protocol`` sockets."""
    rows: dict[int, tuple[str, int, str]] = {}
    for name, family in ((protocol, socket.AF_INET), (protocol + "6", socket.AF_INET6)):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            # /proc prints each 32-bit word of the address in host (little-endian) order.
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            rows[int(fields[9])] = (socket.inet_ntop(family, raw), int(port, 16), fields[3])
    return rows


def listening_sockets(pids: Iterable[int]) -> list[ListeningSocket]:
    """TCP sockets in LISTEN and bound UDP sockets held open by ``pids``."""
    found = []
    for pid in pids:
        tables = {"tcp": _sockets(pid, "tcp"), "udp": _sockets(pid, "udp")}
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if not link.startswith("socket:["):
                continue
            inode = int(link[len("socket:["):-1])
            for protocol, table in tables.items():
                if inode in table:
                    host, port, state = table[inode]
                    if protocol == "udp" or state == _TCP_LISTEN:
                        found.append(ListeningSocket(pid, title(pid), protocol, host, port))
    return found


def replica_pids(app: str, role: str) -> list[int]:
    """Pids of app ``app``'s ``role`` replicas among this test process's descendants."""
    marker = f"ray::ServeReplica:{app}:{role}"
    return [pid for pid in descendants(os.getpid()) if title(pid).startswith(marker)]


def rank_pids() -> list[int]:
    """Pids of tensor-parallel rank actors (ranks other than 0) among this test process's
    descendants."""
    return [pid for pid in descendants(os.getpid()) if title(pid).startswith("ray::TPRank")]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    raise AssertionError(f"no VmRSS for {pid}")
