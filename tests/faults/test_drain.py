"""SIGTERM to `pdserve serve` drains: new requests get 503 at once, open streams that can
finish within `http.drain_timeout_s` finish normally, the rest end with an error event and
[DONE]; then the server exits 0 and leaves no process behind."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support.pdserve_process import pdserve_serve
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
DRAIN_TIMEOUT_S = 3.0


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
    with pdserve_serve(tmp_path, tiny_checkpoints["llama"], served_model_name="m",
                       http={"drain_timeout_s": DRAIN_TIMEOUT_S}) as server:
        url = server.url
        short, long = Stream(url, 40), Stream(url, 4000)
        for stream in (short, long):
            stream.start()
            assert stream.started.wait(60)

        sent_at = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        wait_for(lambda: server.health() == 503, 20, "/health to say draining", interval_s=0.02)
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
        assert server.process.wait(60) == 0
        # Stopped after the grace period, not at once and not much later.
        assert DRAIN_TIMEOUT_S <= time.monotonic() - sent_at < DRAIN_TIMEOUT_S + 50
        wait_for(lambda: not server.processes(), 30, "its Ray processes to exit")
