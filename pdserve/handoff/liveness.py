"""Whether a peer process on this machine still exists: a restarted or killed peer is known
gone at once, not only after it fell silent (UCX reports nothing over shared memory).
"""

from __future__ import annotations

import os


def pid_scope(host: str) -> str:
    """Processes with equal scopes see each other's pids: the same machine and pid namespace."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = "no-pid-namespace"
    return f"{host}/{namespace}"


def why_gone(pid: int | None, last_heard: float, now: float, timeout: float) -> str | None:
    """Why a peer counts as gone: its process (``pid``, when in our pid scope) exited, or it
    was silent for ``timeout``; None while it may be alive."""
    if pid is not None and not process_alive(pid):
        return f"peer process {pid} exited"
    if now - last_heard > timeout:
        return f"peer silent for over {timeout}s"
    return None


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` in our pid namespace can still run (a zombie cannot)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    except OSError:  # no procfs: ask the kernel (a zombie then counts as alive)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return state not in ("Z", "X")
