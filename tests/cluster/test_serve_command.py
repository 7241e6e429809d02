"""`pdserve serve` as users run it: its own process and local Ray, one chat over HTTP served
by the ingress replica itself (no proxy hop), then SIGTERM (what process managers send),
after which it exits 0 and leaves nothing running.
"""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest

from tests.support.pdserve_process import pdserve_serve
from tests.support.processes import listening_sockets
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(300)


def test_pdserve_serve_answers_then_stops_cleanly_on_sigterm(
        tmp_path: Path, tiny_checkpoints: dict[str, str]) -> None:
    with pdserve_serve(tmp_path, tiny_checkpoints["llama"]) as server:
        url = server.url
        reply = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": httpx.get(f"{url}/v1/models").json()["data"][0]["id"], "max_tokens": 4,
            "messages": [{"role": "user", "content": "hello " * 40}]})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
        port = int(url.rsplit(":", 1)[1])
        # Direct ingress: the ingress replica itself holds the port.
        [owner] = [s for s in listening_sockets(server.processes())
                   if s.protocol == "tcp" and s.port == port]
        assert "ingress" in owner.title

        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(60) == 0
        wait_for(lambda: not server.processes(), 30, "its Ray processes to exit")
