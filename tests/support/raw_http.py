"""HTTP/1.1 over bare sockets, for tests that need what a full client hides or costs: hundreds
of requests at once from one core, and clients that stop reading with a tiny receive buffer.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


@dataclass(frozen=True)
class RawResponse:
    status: int
    headers: dict[str, str]  # names lower-cased
    body: bytes  # as sent (a stream's SSE events, chunked transfer coding undone)
    latency_s: float  # from connecting to the end of the body


def request_bytes(url: str, path: str, body: dict[str, Any] | None = None) -> bytes:
    """A POST of ``body`` as JSON (a GET without one) to ``path`` below ``url``; the server
    closes the connection after answering."""
    parts = urlsplit(url)
    payload = b"" if body is None else json.dumps(body).encode()
    method = "GET" if body is None else "POST"
    head = (f"{method} {parts.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
            "Connection: close\r\n\r\n")
    return head.encode() + payload


def address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None, url
    return parts.hostname, parts.port


async def fetch(url: str, path: str, body: dict[str, Any] | None = None) -> RawResponse:
    """POST ``body`` (GET without one) and read the whole answer."""
    start = time.monotonic()
    reader, writer = await asyncio.open_connection(*address(url))
    try:
        writer.write(request_bytes(url, path, body))
        raw = await reader.read()
    finally:
        writer.close()
    return parse(raw, time.monotonic() - start)


def parse(raw: bytes, latency_s: float) -> RawResponse:
    """The response in ``raw``; ConnectionResetError if the server closed without one."""
    head, found, rest = raw.partition(b"\r\n\r\n")
    if not found:
        raise ConnectionResetError(f"the server closed after {len(raw)} bytes, no answer")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    body = _unchunk(rest) if headers.get("transfer-encoding") == "chunked" else rest
    return RawResponse(int(lines[0].split()[1]), headers, body, latency_s)


def _unchunk(data: bytes) -> bytes:
    out, pos = bytearray(), 0
    while pos < len(data):
        end = data.find(b"\r\n", pos)
        if end < 0:
            break
        size = int(data[pos:end].split(b";")[0], 16)
        if size == 0:
            break
        out += data[end + 2:end + 2 + size]
        pos = end + 2 + size + 2
    return bytes(out)


def open_unread(url: str, path: str, body: dict[str, Any], receive_buffer: int = 2048
                ) -> socket.socket:
    """Send the request on a socket with a ``receive_buffer``-byte receive buffer and never
    read it: the server's writes back up once that buffer and its own are full."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)  # before connect
    sock.connect(address(url))
    sock.sendall(request_bytes(url, path, body))
    return sock
