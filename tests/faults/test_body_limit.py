"""The request body limit over real HTTP: a declared Content-Length over it gets 413 before
any body is sent; a chunked body gets 413 while the client is still sending it (the server
stopped reading); bodies under it are served, chunked or not; the server keeps serving.
"""

from __future__ import annotations

import json
import select
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from tests.faults.edge_apps import OPEN_BODY_LIMIT, assert_openai_error

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]

ANSWER_TIMEOUT_S = 30.0
PACE_S = 0.01


def _connect(url: str, headers: dict[str, str]) -> tuple[socket.socket, bytes]:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=ANSWER_TIMEOUT_S)
    lines = [f"POST {parts.path}/v1/chat/completions HTTP/1.1", f"Host: {parts.netloc}",
             "Content-Type: application/json", *(f"{k}: {v}" for k, v in headers.items())]
    return sock, ("\r\n".join(lines) + "\r\n\r\n").encode()


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _read_answer(sock: socket.socket) -> tuple[int, dict]:
    """Status and JSON body of one HTTP/1.1 answer (Content-Length framed)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before an answer: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    status = int(head.split(b" ", 2)[1])
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-answer"
        body += chunk
    return status, json.loads(body[:length])


def test_declared_length_over_the_limit_is_refused_before_the_body(open_app: str) -> None:
    sock, head = _connect(open_app, {"Content-Length": str(100 * 1024 * 1024)})
    with sock:
        sock.sendall(head)  # headers only: an answer now means nothing of the body was read
        status, body = _read_answer(sock)
    assert status == 413
    error = assert_openai_error(body, code="request_too_large")
    assert str(OPEN_BODY_LIMIT) in error["message"] and str(100 * 1024 * 1024) in error["message"]


def test_chunked_body_is_refused_while_still_being_sent(open_app: str) -> None:
    """A client that keeps sending a chunked body, at a steady pace, until it is answered."""
    sock, head = _connect(open_app, {"Transfer-Encoding": "chunked"})
    piece = 32 * 1024
    chunk = _chunk(b"x" * piece)
    start = b'{"model": "tiny", "messages": [{"role": "user", "content": "'
    sent, deadline = len(start), time.monotonic() + ANSWER_TIMEOUT_S  # body bytes sent
    with sock:
        sock.sendall(head + _chunk(start))
        while not select.select([sock], [], [], PACE_S)[0]:  # about 3 MB/s
            assert time.monotonic() < deadline, f"no answer after sending {sent} bytes"
            sock.sendall(chunk)
            sent += piece
        status, body = _read_answer(sock)
    assert status == 413
    assert_openai_error(body, code="request_too_large")
    assert sent > OPEN_BODY_LIMIT  # answered once the limit was passed, not before


@pytest.mark.parametrize("chunked", [False, True])
def test_bodies_under_the_limit_are_served(open_app: str, chunked: bool) -> None:
    content = "word " * ((OPEN_BODY_LIMIT - 1024) // 5 // 64)  # well under the limit in bytes
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": content[:200]}],
                       "max_tokens": 2}).encode()
    payload = (body[i:i + 100] for i in range(0, len(body), 100)) if chunked else body
    r = httpx.post(f"{open_app}/v1/chat/completions", content=payload, timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def test_server_keeps_serving_after_refusals(open_app: str) -> None:
    big = {"model": "tiny", "messages": [{"role": "user", "content": "y" * (OPEN_BODY_LIMIT + 1)}]}
    r = httpx.post(f"{open_app}/v1/chat/completions", json=big, timeout=60)
    assert r.status_code == 413
    assert_openai_error(r.json(), code="request_too_large")
    assert httpx.get(f"{open_app}/health", timeout=30).status_code == 200
    r = httpx.post(f"{open_app}/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": "hello", "max_tokens": 2})
    assert r.status_code == 200, r.text
