"""Whether a peer process on this host still exists: the one fact UCX cannot give us over
shared memory without endpoint error handling (a dead sender's receive just never ends).
"""

from __future__ import annotations

import os


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` on this host can still run (a zombie cannot)."""
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
