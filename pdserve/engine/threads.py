"""Names for pdserve's own threads at the OS level (Linux), where Python's names do not reach.

Per-thread CPU in /proc/PID/task and profilers then tell the engine and handoff threads apart.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_PR_SET_NAME = 15
_MAX_NAME = 15  # bytes the kernel keeps


def name_native_thread(name: str) -> None:
    """Give the calling thread ``name`` (its first 15 bytes) where the OS keeps one."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is not None:
        ctypes.CDLL(libc_name).prctl(_PR_SET_NAME, name.encode()[:_MAX_NAME], 0, 0, 0)
