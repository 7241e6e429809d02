"""`pdserve serve` runs as two processes: the one users and process managers signal, and the
server it starts in a process group of its own, with Ray's processes below the server.

A signal sent to a process group (a terminal's Ctrl-C, `kill -- -PGID`) reaches every process
in it: with Ray's GCS and raylet in pdserve's group they would die at once, and the server
could not drain through them. The supervisor takes SIGTERM, SIGINT and SIGHUP however
they arrive and hands the server one SIGTERM; the server drains, stops Serve and its Ray, and
exits; the supervisor exits with its code. If the supervisor dies first, the kernel sends the
server SIGTERM (PR_SET_PDEATHSIG), and Ray's processes go with the server.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys

# Set in the server's environment: it is the supervised server (and names its supervisor).
SUPERVISOR_ENV = "PDSERVE_SUPERVISOR_PID"
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


def is_supervised() -> bool:
    return SUPERVISOR_ENV in os.environ


def supervise(argv: list[str]) -> int:
    """Run ``pdserve ARGV`` as the server in a process group of its own; return its exit
    code (128 + the signal's number if a signal ended it)."""
    env = os.environ | {SUPERVISOR_ENV: str(os.getpid())}
    server = subprocess.Popen([sys.executable, "-m", "pdserve.cli", *argv], env=env,
                              process_group=0)

    def forward(signum: int, frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.pid, signal.SIGTERM)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    code = server.wait()
    return 128 - code if code < 0 else code


def follow_supervisor() -> None:
    """In the server: receive SIGTERM when the supervisor dies (it drains then, as when told
    to stop), and ignore SIGTTOU, which a terminal with `stty tostop` sends a process group
    that is not in its foreground when it writes."""
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        return
    if os.getppid() != int(os.environ[SUPERVISOR_ENV]):  # it died before the call above
        os.kill(os.getpid(), signal.SIGTERM)
