"""`pdserve serve` as users run it: its own process and local Ray, one chat over HTTP served
by the ingress replica itself (no proxy hop), then SIGTERM (what process managers send),
after which it exits 0 and leaves nothing running.
"""

from __future__ import annotations

import os
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


def test_pdserve_serve_runs_a_decode_replica_of_two_ranks_on_the_cores_it_has(
        tmp_path: Path, tiny_checkpoints: dict[str, str]) -> None:
    """Prefill 1 rank + decode 2 ranks need 3 logical CPUs: on fewer cores the local Ray is
    started with 3 and the start-up line says the ranks share cores."""
    roles = {"prefill": {"replicas": 1, "resources": {"num_cpus": 1}},
             "decode": {"replicas": 1, "tensor_parallel_size": 2,
                        "resources": {"num_cpus": 1}}}
    with pdserve_serve(tmp_path, tiny_checkpoints["llama"], roles=roles) as server:
        url = server.url
        reply = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": httpx.get(f"{url}/v1/models").json()["data"][0]["id"], "max_tokens": 4,
            "messages": [{"role": "user", "content": "hello " * 40}], "pdserve_timings": True})
        assert reply.status_code == 200, reply.text
        assert reply.json()["pdserve_timings"][0]["path"] == "disaggregated"
        shared = "pdserve starts its local Ray with 3 logical CPUs"
        assert (shared in server.log_path.read_text()) == ((os.cpu_count() or 1) < 3)
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(60) == 0
        wait_for(lambda: not server.processes(), 30, "its Ray processes to exit")
