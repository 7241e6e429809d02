"""The ingress's HTTP listening socket, set up through Serve's own bind (`http_socket`): a
restarted ingress binds its port again at once with its predecessor's connections still
lingering on it, and connections get a bounded send buffer."""

from __future__ import annotations

import subprocess
import sys

from pdserve.router.http_socket import SEND_BUFFER_BYTES


def start_twice(mode: str) -> str:
    done = subprocess.run([sys.executable, "-m", "tests.router.http_socket_child", mode],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def test_serve_binds_its_port_again_through_lingering_connections() -> None:
    assert start_twice("tuned") == f"rebound {2 * SEND_BUFFER_BYTES}"  # the kernel doubles it


def test_serve_alone_is_refused_its_port_while_connections_linger() -> None:
    """The lingering connection is real, and is why the switch exists (Serve 2.60): without
    it the second bind fails, and Serve would move the ingress to another port."""
    assert start_twice("plain") == "refused"
