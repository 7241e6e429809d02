"""Errors that reach the client name no internals: a decode replica killed under a stream and
under a plain request gives an error event / a 503 with OpenAI's body and no pid, actor id,
namespace, address, traceback or Ray wrapper text; the detail is in the server's log.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from tests.faults.edge_apps import assert_openai_error
from tests.support.processes import replica_pids
from tests.support.ray_serve import app_config
from tests.support.waiting import wait_for

if TYPE_CHECKING:
    from tests.support.ray_serve import ServedApps

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]

APP = "leak"
LONG = {"model": "tiny", "messages": [{"role": "user", "content": "count"}], "max_tokens": 3000,
        "temperature": 0, "ignore_eos": True}
INTERNALS = {
    "a pid": re.compile(r"\bpid\b", re.I),
    "an actor or node id": re.compile(r"\b[0-9a-f]{16,}\b"),
    "a namespace": re.compile(r"namespace", re.I),
    "an IP address": re.compile(r"\b\d{1,3}(\.\d{1,3}){3}\b"),
    "a traceback": re.compile(r"Traceback|File \"", re.I),
    "Ray's wrapper text": re.compile(r"\bray\b|actor|RayTaskError|ActorDiedError", re.I),
}


@pytest.fixture(scope="module")
def leak_app(ray_serve: ServedApps, tiny_checkpoints: dict[str, str]) -> Iterator[str]:
    with ray_serve.deploy(APP, app_config(tiny_checkpoints["llama"], "colocated")) as url:
        yield url


def _decode_replica_pid() -> int:
    pids = replica_pids(APP, "decode")
    assert len(pids) == 1, pids
    return pids[0]


def _decode_is_busy() -> bool:
    from ray import serve

    handle = serve.get_deployment_handle("decode", app_name=APP)
    return handle.kv_stats.remote().result(timeout_s=30)["num_running"] > 0


def _recovered(url: str) -> bool:
    try:
        r = httpx.post(f"{url}/v1/chat/completions", timeout=30, json=LONG | {"max_tokens": 2})
    except httpx.HTTPError:
        return False
    return r.status_code == 200


def _assert_no_internals(message: str) -> None:
    for what, pattern in INTERNALS.items():
        assert not pattern.search(message), f"error message shows {what}: {message!r}"


def _logged(detail: str) -> bool:
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    return any(detail in path.read_text(errors="replace")
               for path in logs.rglob("*") if path.is_file() and path.suffix in {".err", ".log"})


def test_stream_cut_by_a_dead_replica_reports_no_internals(leak_app: str) -> None:
    payloads: list[str] = []
    with httpx.stream("POST", f"{leak_app}/v1/chat/completions", timeout=120,
                      json=LONG | {"stream": True}) as r:
        assert r.status_code == 200
        killed = False
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            payloads.append(line.removeprefix("data: "))
            if not killed and '"content":"' in line and '"content":""' not in line:
                os.kill(_decode_replica_pid(), signal.SIGKILL)
                killed = True
    assert killed and payloads[-1] == "[DONE]", payloads[-3:]
    error = assert_openai_error(json.loads(payloads[-2]))
    assert error["type"] == "server_error"
    _assert_no_internals(error["message"])
    # The token plane sees the connection drop first, or the Serve call fails first.
    wait_for(lambda: _logged("dropped its token-plane connection with generations open (1)")
             or _logged("a stream failed (answered 503): ActorDiedError"), 30,
             "the failure's detail in the server log")
    wait_for(lambda: _recovered(leak_app), 120, "a replacement decode replica")


def test_request_cut_by_a_dead_replica_gets_a_plain_503(leak_app: str) -> None:
    wait_for(lambda: _recovered(leak_app), 120, "a live decode replica")
    answers: list[httpx.Response] = []
    request = threading.Thread(target=lambda: answers.append(
        httpx.post(f"{leak_app}/v1/chat/completions", json=LONG, timeout=120)))
    request.start()
    wait_for(_decode_is_busy, 60, "the request to be decoding")
    os.kill(_decode_replica_pid(), signal.SIGKILL)
    request.join(120)
    [answer] = answers
    assert answer.status_code == 503, answer.text
    error = assert_openai_error(answer.json(), code="service_unavailable")
    _assert_no_internals(error["message"])
    wait_for(lambda: _logged("dropped its token-plane connection with generations open (1)")
             or _logged("completions failed (answered 503): ActorDiedError"), 30,
             "the failure's detail in the server log")
    wait_for(lambda: _recovered(leak_app), 120, "a replacement decode replica")
