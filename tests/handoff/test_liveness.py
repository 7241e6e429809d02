"""Process liveness for the receiver's write watchdog: running, zombie, gone (no UCX)."""

from __future__ import annotations

import os
import subprocess
import time

from pdserve.handoff.liveness import process_alive


def test_running_zombie_and_reaped_processes() -> None:
    assert process_alive(os.getpid())
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert process_alive(child.pid)
        child.kill()
        deadline = time.monotonic() + 10
        # Killed but not yet reaped: a zombie, which can never write again.
        while process_alive(child.pid):
            assert time.monotonic() < deadline, "killed child still counted as alive"
            time.sleep(0.01)
        assert child.poll() is not None  # it was a zombie until this reaped it
        assert not process_alive(child.pid)
    finally:
        child.kill()
        child.wait()
