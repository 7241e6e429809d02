"""The child side of the HTTP socket test: starts Serve's direct-ingress HTTP server on a
port, leaves a connection lingering on it (the server closes first: TIME_WAIT), stops it and
starts it again on the same port; prints `rebound SNDBUF` (the listener's send buffer) or
`refused`. Its own process, because the switch it tests stays on for the process.
"""

from __future__ import annotations

import asyncio
import socket
import sys

from pdserve.router.http_socket import tune_serve_http_socket
from tests.support import raw_http
from tests.support.processes import free_port


async def answer(scope: dict, receive: object, send: object) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})  # type: ignore
    await send({"type": "http.response.body", "body": b"ok"})  # type: ignore


async def start_twice(tuned: bool) -> str:
    from ray.serve._private import replica
    from ray.serve.config import HTTPOptions

    if tuned:
        assert tune_serve_http_socket()
    port, send_buffer = free_port(), 0
    for attempt in ("first", "again"):
        try:
            task, server = await replica.start_asgi_http_server(
                answer, HTTPOptions(host="127.0.0.1", port=port),
                event_loop=asyncio.get_running_loop())
        except RuntimeError:
            return "refused"
        while not server.started:
            await asyncio.sleep(0.01)
        listener = server.servers[0].sockets[0]
        send_buffer = listener.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        reply = await raw_http.fetch(f"http://127.0.0.1:{port}", "/")  # Connection: close
        assert reply.status == 200, (attempt, reply)
        server.should_exit = True
        await task
    return f"rebound {send_buffer}"


if __name__ == "__main__":
    print(asyncio.run(start_twice(sys.argv[1] == "tuned")))
