"""Fault points: named phases of a request's handoff (and of a prefix load from another KV
tier) where a test may make a worker die as the OS kills a process (SIGKILL), to prove a
death at exactly that phase loses nothing.

Arming needs PDSERVE_FAULT_POINTS=1 in the worker's environment (the test suite sets it);
without it `arm` refuses and `hit` costs one attribute test on the paths that call it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

ENV_VAR = "PDSERVE_FAULT_POINTS"

# Each point, where it sits and what has happened when the process dies there.
POINTS = {
    "prefill.reserved": "a prefill call arrived: decode reserved blocks, nothing was sent",
    "prefill.mid_layers": "the prompt's last chunk sent half its layers",
    "prefill.layers_sent": "every layer was sent, the fence was not",
    "prefill.fence_verified": "decode verified the fence; the first token never reached the "
                              "ingress",
    "prefill.releasing": "every send was released; the blocks were not freed yet",
    "decode.awaiting_kv": "decode handed out its ticket and waits for the KV",
    "decode.fence_verified": "the fence verified; the request has not joined the batch",
    "decode.decoding": "the request produced tokens after the first",
}
# Points outside the handoff: an app without that tier never reaches them.
TIER_POINTS = {
    "prefill.loading_kv": "a request's prefix copy from the host tier or the store was "
                          "submitted; the request waits for it (LOADING_KV)",
}


class UnknownFaultPointError(ValueError):
    """A fault point name that no worker hits."""


class FaultPoints:
    """The points armed in this process; each kills it at its next hit, once."""

    def __init__(self, enabled: bool | None = None,
                 die: Callable[[], None] | None = None) -> None:
        self.enabled = os.environ.get(ENV_VAR) == "1" if enabled is None else enabled
        self._die = die or _kill_self
        self._armed: set[str] = set()
        self._lock = threading.Lock()

    def arm(self, name: str) -> None:
        if not self.enabled:
            raise RuntimeError(f"fault points are off in this worker (set {ENV_VAR}=1 in its "
                               "environment to arm them)")
        if name not in POINTS and name not in TIER_POINTS:
            raise UnknownFaultPointError(
                f"no fault point {name!r}; known: {', '.join(sorted(POINTS | TIER_POINTS))}")
        with self._lock:
            self._armed.add(name)

    def armed(self, name: str) -> bool:
        return bool(self._armed) and name in self._armed

    def hit(self, name: str) -> None:
        """Die here if ``name`` is armed."""
        if not self._armed:
            return
        with self._lock:
            if name not in self._armed:
                return
            self._armed.discard(name)
        self._die()


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # SIGKILL is delivered before this returns; nothing after it runs
