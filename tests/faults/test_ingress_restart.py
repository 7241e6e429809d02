"""kill -9 of the ingress replica, three times in a row under traffic: each time Serve starts
a new one, which serves `http.port` again (never the ports after it), whatever connections
of the dead one linger on the port, and shows every role's KV gauges in /metrics."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.support import raw_http
from tests.support.pdserve_process import ServeProcess, pdserve_serve
from tests.support.processes import listening_sockets, title
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]
RESTARTS = 3
RESTART_WITHIN_S = 60.0
SHORT = {"model": "m", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
LONG = {**SHORT, "max_tokens": 3000, "ignore_eos": True, "stream": True}


def ingress_pids(server: ServeProcess) -> list[int]:
    return [pid for pid in server.processes()
            if title(pid).startswith("ray::ServeReplica:pdserve:ingress")]


class Traffic(threading.Thread):
    """Short completions back to back over fresh connections (the server closes each one
    first, so they linger in TIME_WAIT on its port), plus a few long streams held open."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.stop = url, threading.Event()
        self.outcomes: Counter[str] = Counter()

    def run(self) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        async def one(body: dict) -> None:
            try:
                reply = await raw_http.fetch(self.url, "/v1/completions", body)
                self.outcomes[str(reply.status)] += 1
            except OSError as exc:
                self.outcomes[type(exc).__name__] += 1

        streams: set[asyncio.Task[None]] = set()
        while not self.stop.is_set():
            while len(streams) < 3:
                task = asyncio.ensure_future(one(LONG))
                streams.add(task)
                task.add_done_callback(streams.discard)
            await one(SHORT)
            await asyncio.sleep(0.02)
        for task in list(streams):
            task.cancel()


def test_a_killed_ingress_serves_its_port_again_three_times_under_traffic(
        tmp_path: Path, tiny_checkpoints: dict[str, str]) -> None:
    with pdserve_serve(tmp_path, tiny_checkpoints["llama"], served_model_name="m") as server:
        port = int(server.url.rsplit(":", 1)[1])
        # /health can answer before `serve` prints its start-up line
        wait_for(lambda: f"HTTP 127.0.0.1:{port}," in server.log_path.read_text(), 30,
                 "the start-up line naming http.port")
        traffic = Traffic(server.url)
        traffic.start()
        times = []
        try:
            for _ in range(RESTARTS):
                served = traffic.outcomes["200"]
                wait_for(lambda served=served: traffic.outcomes["200"] >= served + 5, 60,
                         "traffic to flow")
                [old] = ingress_pids(server)
                killed_at = time.monotonic()
                os.kill(old, signal.SIGKILL)

                def back(old: int = old) -> bool:
                    pids = ingress_pids(server)
                    return pids not in ([], [old]) and server.health() == 200

                wait_for(back, RESTART_WITHIN_S, "the restarted ingress on http.port",
                         interval_s=0.1)
                times.append(time.monotonic() - killed_at)
                [new] = ingress_pids(server)
                ports = {s.port for s in listening_sockets([new]) if s.host == "127.0.0.1"}
                assert port in ports and not ports & set(range(port + 1, port + 17)), ports
            served = traffic.outcomes["200"]
            wait_for(lambda: traffic.outcomes["200"] >= served + 5, 60, "traffic to flow again")
        finally:
            traffic.stop.set()
            traffic.join(30)
        metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
        for role in ("decode", "prefill"):
            assert f'role="{role}"' in metrics.split("pdserve:kv_cache_usage_perc")[-1], role
        # While no ingress runs, connections are refused or cut; no request got an error.
        assert set(traffic.outcomes) <= {"200", "ConnectionRefusedError",
                                         "ConnectionResetError"}, traffic.outcomes
    print(f"kill -9 of the ingress, {RESTARTS} times under traffic: http.port {port} served "
          f"again after {', '.join(f'{t:.1f}' for t in times)} s; traffic "
          f"{dict(traffic.outcomes)}")
