"""`ray stop` scoped to one namespace host (`python -m tests.support.host_ray_stop`): the Ray
processes of this host's network namespace, as `ray stop` stops those of its machine.

Hosts made of namespaces share one pid namespace, so Ray's own `ray stop` would stop every
Ray on the real machine; the multi-host tests put this first on each host's PATH instead.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path

from ray.autoscaler._private.constants import RAY_PROCESSES

from tests.support.processes import title
from tests.support.waiting import wait_for


def is_ray(pid: int) -> bool:
    """Whether ``pid`` is a process `ray stop` stops: its list matches the executable's name
    (15 characters, as Linux keeps it) or the whole command line."""
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return False
    args = title(pid)
    return any((keyword[:15] in name) if by_name else (keyword in args)
               for keyword, by_name in RAY_PROCESSES)


def in_network(pid: int, network: str) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/ns/net") == network
    except OSError:
        return False


def ray_pids(network: str) -> list[int]:
    """Ray's processes in network namespace ``network`` (a /proc/PID/ns/net link)."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()
            and in_network(int(p), network) and is_ray(int(p))]


def main(grace_s: float = 10.0) -> int:
    network = os.readlink("/proc/self/ns/net")
    found = ray_pids(network)
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for pid in ray_pids(network):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        with contextlib.suppress(AssertionError):
            wait_for(lambda: not ray_pids(network), wait_s, "Ray to stop", interval_s=0.2)
            break
    print(f"Stopped all {len(found)} Ray processes of this host.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
