"""The options of the ingress's HTTP listening socket, set through Serve's own bind: the port
survives a restart of the ingress, and a client that stops reading shows within a few
hundred KiB.

- SO_REUSEADDR. Serve (2.60) binds a direct-ingress replica's port without it, and Linux
  refuses such a bind while connections of a dead replica linger on the port (TIME_WAIT,
  FIN_WAIT): Serve then blocks that port for good and takes the next one, so every restart
  walks the port range. Linux lets a bind with SO_REUSEADDR through lingering connections
  only if those had it too, so every ingress binds that way from its first start. (Not
  SO_REUSEPORT: a second server must still fail to take a port one serves.)
- SO_SNDBUF. Connections inherit the listener's send buffer. Left to autotuning it grows to
  4 MiB on a connection whose client reads nothing, which takes over a thousand tokens of a
  stream with logprobs before the server's send blocks and the stall watch can see it
  (`stalls.py`). Bounded, the send blocks after about 200 KiB (this buffer, which the kernel
  doubles, and the transport's 64 KiB); a connection still moves SEND_BUFFER_BYTES * 2 per
  round trip (2.6 MB/s over 100 ms), far above a token stream.
"""

from __future__ import annotations

import logging
import socket
import sys
from typing import Any

logger = logging.getLogger(__name__)

SEND_BUFFER_BYTES = 64 << 10
_REPLICA_MODULE = "ray.serve._private.replica"


def set_listener_options(sock: socket.socket) -> bool:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
    return True


def tune_serve_http_socket() -> bool:
    """In a Serve replica process (before its direct-ingress server starts): make Serve's HTTP
    bind set `set_listener_options`. Returns whether it does (False outside a replica, and
    where this Serve starts its server in another way, which is logged)."""
    replica = sys.modules.get(_REPLICA_MODULE)
    if replica is None:  # not a Serve replica (unit tests, the driver)
        return False
    from ray.serve._private import http_util

    start = getattr(replica, "start_asgi_http_server", None)
    if getattr(start, "tuned_by_pdserve", False):
        return True
    if start is None or not hasattr(http_util, "set_socket_reuse_port"):
        logger.warning("this Ray Serve starts its HTTP server in another way: a restarted "
                       "ingress may come back on another port, and clients that stop reading "
                       "show only once the kernel's buffers fill (docs/cluster.md)")
        return False

    async def start_tuned(*args: Any, **kwargs: Any) -> Any:
        # Serve's SO_REUSEPORT switch is its one hook into the socket before the bind; the
        # hook, replaced below, sets pdserve's options instead.
        return await start(*args, **{**kwargs, "enable_so_reuseport": True})

    start_tuned.tuned_by_pdserve = True  # type: ignore[attr-defined]
    http_util.set_socket_reuse_port = set_listener_options
    replica.start_asgi_http_server = start_tuned
    return True
