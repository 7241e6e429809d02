"""SIGTERM to `pdserve serve` drains: new requests get 503 at once, open streams that can
finish within `http.drain_timeout_s` finish normally, the rest end with an error event and
[DONE]; then the server exits 0 and leaves no process behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from served import free_port_range, wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
PDSERVE = str(Path(sys.executable).parent / "pdserve")
LOCAL_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local.yaml"
DRAIN_TIMEOUT_S = 3.0


def pids_in_session(sid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2:].split()[3]) == sid:
            pids.append(int(entry))
    return pids


class Stream(threading.Thread):
    """A streamed completion read to its end in the background."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.events: list[str] = []
        self.started = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"model": "m", "prompt": "Once upon a time", "max_tokens": self.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: "):])
                        self.started.set()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def finish_reasons(self) -> list[str]:
        return [c["finish_reason"] for e in self.events if e.startswith("{")
                for c in json.loads(e).get("choices", []) if c.get("finish_reason")]

    def errors(self) -> list[dict]:
        return [json.loads(e)["error"] for e in self.events
                if e.startswith("{") and "error" in json.loads(e)]


def test_sigterm_drains_open_streams_and_refuses_new_requests(
        tmp_path: Path, tiny_checkpoints: dict[str, str]) -> None:
    config = yaml.safe_load(LOCAL_CONFIG.read_text())
    config["model"] = {"path": tiny_checkpoints["llama"], "dtype": "float32"}
    config["served_model_name"] = "m"
    port = free_port_range(17)
    config["http"] = {"host": "127.0.0.1", "port": port, "drain_timeout_s": DRAIN_TIMEOUT_S}
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        server = subprocess.Popen([PDSERVE, "serve", str(path)], stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True,
                                  env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _status(url) == 200 or server.poll() is not None, 180, "server up")
        assert server.poll() is None, log_path.read_text()[-3000:]
        short, long = Stream(url, 40), Stream(url, 4000)
        for stream in (short, long):
            stream.start()
            assert stream.started.wait(60)

        sent_at = time.monotonic()
        server.send_signal(signal.SIGTERM)
        wait_for(lambda: _status(url) == 503, 20, "/health to say draining", interval_s=0.02)
        refused = httpx.post(f"{url}/v1/completions", timeout=10, json={
            "model": "m", "prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503
        assert "shutting down" in refused.json()["error"]["message"]

        short.join(60)
        long.join(60)
        assert short.error is None and long.error is None
        assert short.finish_reasons() == ["length"] and short.events[-1] == "[DONE]"
        assert not short.errors()
        assert long.events[-1] == "[DONE]" and long.finish_reasons() == []
        [error] = long.errors()
        assert "shutting down" in error["message"] and error["code"] == "service_unavailable"
        assert server.wait(60) == 0
        # Stopped after the grace period, not at once and not much later.
        assert DRAIN_TIMEOUT_S <= time.monotonic() - sent_at < DRAIN_TIMEOUT_S + 50
        wait_for(lambda: not pids_in_session(server.pid), 30, "its Ray processes to exit")
    finally:
        for pid in [server.pid, *pids_in_session(server.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _status(url: str) -> int | None:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code
    except httpx.HTTPError:
        return None
