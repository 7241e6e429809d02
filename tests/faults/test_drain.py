"""`pdserve serve` drains the same way whichever of its processes a stop signal reaches first:
SIGTERM to its pid, SIGTERM to its whole process group (systemd's and `kill -- -PGID`'s way)
and SIGINT to the group (a terminal's Ctrl-C). New requests get 503 `draining` within a
second; of 8 open streams, those that can finish within `http.drain_timeout_s` do, the rest
end with an error event and [DONE]; the server exits 0 and leaves no process or listener."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support.pdserve_process import ServeProcess, pdserve_serve
from tests.support.raw_http import address
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
DRAIN_TIMEOUT_S = 3.0
DRAINING_WITHIN_S = 1.0
EXIT_WITHIN_S = DRAIN_TIMEOUT_S + 15.0
NUM_STREAMS = 8


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


def _send(server: ServeProcess, how: str) -> None:
    pgid = os.getpgid(server.process.pid)
    {"pid SIGTERM": lambda: os.kill(server.process.pid, signal.SIGTERM),
     "group SIGTERM": lambda: os.killpg(pgid, signal.SIGTERM),
     "group SIGINT": lambda: os.killpg(pgid, signal.SIGINT)}[how]()


def _refused(url: str) -> bool:
    try:
        with socket.create_connection(address(url), timeout=2):
            return False
    except ConnectionRefusedError:
        return True


@pytest.mark.parametrize("how", ["pid SIGTERM", "group SIGTERM", "group SIGINT"])
def test_a_stop_signal_drains_open_streams_and_refuses_new_requests(
        tmp_path: Path, tiny_checkpoints: dict[str, str], how: str) -> None:
    with pdserve_serve(tmp_path, tiny_checkpoints["llama"], served_model_name="m",
                       http={"drain_timeout_s": DRAIN_TIMEOUT_S}) as server:
        url = server.url
        # Half finish well within the drain timeout, half could not finish within it.
        streams = [Stream(url, 40 if k % 2 == 0 else 4000) for k in range(NUM_STREAMS)]
        for stream in streams:
            stream.start()
        for stream in streams:
            assert stream.started.wait(60)

        sent_at = time.monotonic()
        _send(server, how)
        wait_for(lambda: server.health() == 503, 20, "/health to say draining", interval_s=0.02)
        draining_s = time.monotonic() - sent_at
        refused = httpx.post(f"{url}/v1/completions", timeout=10, json={
            "model": "m", "prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503
        assert "shutting down" in refused.json()["error"]["message"]

        for stream in streams:
            stream.join(60)
        for k, stream in enumerate(streams):
            assert stream.error is None and stream.events[-1] == "[DONE]", (k, stream.events[-3:])
            if k % 2 == 0:
                assert stream.finish_reasons() == ["length"] and not stream.errors()
            else:
                [error] = stream.errors()
                assert stream.finish_reasons() == []
                assert "shutting down" in error["message"]
                assert error["code"] == "service_unavailable"
        assert server.process.wait(EXIT_WITHIN_S) == 0
        exited_s = time.monotonic() - sent_at
        # Stopped after the grace period, not at once.
        assert exited_s >= DRAIN_TIMEOUT_S
        wait_for(lambda: not server.processes(), 30, "its Ray processes to exit")
        assert _refused(url)
    print(f"{how}: 503 draining after {draining_s:.2f} s, {NUM_STREAMS} streams ended (half "
          f"finished, half with an error event and [DONE]), exit 0 after {exited_s:.1f} s "
          f"(drain_timeout_s {DRAIN_TIMEOUT_S:g}), no process or listener left")
    assert draining_s <= DRAINING_WITHIN_S
