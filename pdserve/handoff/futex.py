"""Futex wait and wake on a 32-bit word in memory that several processes map (Linux only):
how a same-host sender wakes the receiver following its read slots without sending a message.

The calls go through ctypes (which releases the GIL while the thread sleeps in the kernel).
"""

from __future__ import annotations

import ctypes
import platform
import sys

# The futex syscall's number differs per architecture; elsewhere slots are not offered.
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not PRIVATE): the word is in a cross-process mapping
_WAKE_ALL = 0x7FFFFFFF

FUTEX_AVAILABLE = sys.platform == "linux" and _SYS_FUTEX is not None


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_syscall = None
if FUTEX_AVAILABLE:
    _syscall = ctypes.CDLL(None, use_errno=True).syscall
    _syscall.restype = ctypes.c_long


def futex_wait(address: int, expected: int, timeout_s: float) -> None:
    """Sleep until the u32 at ``address`` is woken, unless it no longer holds ``expected``;
    at most ``timeout_s``. Spurious returns are possible: callers re-check their condition."""
    if _syscall is None:
        raise OSError("futex is not available on this platform")
    timeout_s = max(0.0, timeout_s)
    whole = int(timeout_s)
    spec = _Timespec(whole, int((timeout_s - whole) * 1e9))
    _syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT,
             ctypes.c_uint32(expected & 0xFFFFFFFF), ctypes.byref(spec), None, 0)


def futex_wake(address: int) -> None:
    """Wake every thread (of any process) sleeping on the u32 at ``address``."""
    if _syscall is None:
        raise OSError("futex is not available on this platform")
    _syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, _WAKE_ALL, None, None, 0)
