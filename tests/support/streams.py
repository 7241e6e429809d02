"""Chat streams held open in threads while a test breaks something under them: each thread
collects its stream's SSE data lines; the start returns once every stream is underway; a
process killed under them ends each with an error event."""

from __future__ import annotations

import json
import os
import signal
import threading
from typing import Any

import httpx


def start_streams(url: str, bodies: list[dict[str, Any]], underway_after: int = 3,
                  timeout_s: float = 60) -> tuple[list[list[str]], list[threading.Thread]]:
    """POST each body (a streaming chat completion) from its own thread; return once every
    stream has delivered ``underway_after`` events: each stream's data lines (filled as they
    arrive) and the threads."""
    events: list[list[str]] = [[] for _ in bodies]
    underway = threading.Barrier(len(bodies) + 1)

    def stream(i: int) -> None:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=bodies[i],
                          timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events[i].append(line[6:])
                    if len(events[i]) == underway_after:
                        underway.wait(timeout_s)

    threads = [threading.Thread(target=stream, args=(i,), daemon=True)
               for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    underway.wait(timeout_s)
    return events, threads


def join_streams(threads: list[threading.Thread], timeout_s: float = 60) -> None:
    """Every stream ended within ``timeout_s`` (each): nothing hangs on what broke."""
    for thread in threads:
        thread.join(timeout_s)
        assert not thread.is_alive(), f"a stream still runs after {timeout_s:.0f}s"


def kill_under_streams(url: str, bodies: list[dict[str, Any]], pid: int) -> list[dict[str, Any]]:
    """SIGKILL ``pid`` once every stream is underway; every stream ends (none hangs) with an
    error event and [DONE]. Each stream's error."""
    events, threads = start_streams(url, bodies)
    os.kill(pid, signal.SIGKILL)
    join_streams(threads)  # within the 120 s request timeout: nothing hangs
    for lines in events:
        assert lines[-1] == "[DONE]", lines[-3:]
    return [json.loads(lines[-2])["error"] for lines in events]
