"""`pdserve serve` as users run it: its own process and local Ray, one chat over HTTP served
by the ingress replica itself (no proxy hop), then SIGTERM (what process managers send),
after which it exits 0 and leaves nothing running.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml
from local_ray import pids_in_sessions, wait_for
from served import free_port_range, listener_pids

pytestmark = pytest.mark.timeout(300)
PDSERVE = str(Path(sys.executable).parent / "pdserve")
LOCAL_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local.yaml"


def test_pdserve_serve_answers_then_stops_cleanly_on_sigterm(
        tmp_path: Path, tiny_checkpoints: dict[str, str]) -> None:
    config = yaml.safe_load(LOCAL_CONFIG.read_text())
    config["model"] = {"path": tiny_checkpoints["llama"], "dtype": "float32"}
    port = free_port_range(17)
    config["http"] = {"host": "127.0.0.1", "port": port}
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    log = (tmp_path / "serve.log").open("w")
    # A session of its own: every Ray process it starts stays in it, so the check below
    # (and the cleanup) sees exactly this server's processes.
    server = subprocess.Popen([PDSERVE, "serve", str(path)], stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True,
                              env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _healthy(url) or server.poll() is not None, 180, "pdserve serve up")
        assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
        reply = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": httpx.get(f"{url}/v1/models").json()["data"][0]["id"], "max_tokens": 4,
            "messages": [{"role": "user", "content": "hello " * 40}]})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
        [owner] = listener_pids(port)  # direct ingress: the ingress replica holds the port
        assert "ingress" in Path(f"/proc/{owner}/cmdline").read_bytes().decode(errors="replace")

        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0
        wait_for(lambda: not pids_in_sessions({server.pid}), 30, "its Ray processes to exit")
    finally:
        for pid in [server.pid, *pids_in_sessions({server.pid})]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        log.close()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
