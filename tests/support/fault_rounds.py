"""Kill rounds: a worker replica dies at one armed fault point (`pdserve.faults`) while
chats are in flight; every answer is classified against the one-engine greedy text.

Shared by `tests/faults/test_handoff_phases.py` and `benchmarks/fault_hammer.py`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import httpx

from tests.support.processes import replica_pids
from tests.support.waiting import wait_for

if TYPE_CHECKING:
    from tests.support.ray_serve import ServedApps

Kind = Literal["right", "error", "wrong"]
MAX_TOKENS = 64


def long_conv(i: int) -> list[dict[str, str]]:
    """A prompt long enough for the disaggregated path (a few hundred tokens)."""
    return [{"role": "user", "content": f"Request {i}: describe the harbour. " * 25}]


def faults_app_config(model_path: str) -> dict[str, Any]:
    """A disaggregated app of one replica per role whose handoffs give up after 8 s."""
    from tests.support.ray_serve import app_config

    raw = app_config(model_path, "disaggregated")
    raw["handoff"]["timeout_s"] = 8
    return raw


def deployed_faults_app(app: str) -> Any:
    """A module fixture: the faults app (`faults_app_config`) deployed as ``app``; its URL."""
    import pytest

    @pytest.fixture(scope="module")
    def fixture(ray_serve: ServedApps, tiny_checkpoints: dict[str, str]) -> Iterator[str]:
        with ray_serve.deploy(app, faults_app_config(tiny_checkpoints["llama"])) as url:
            yield url
    return fixture


def greedy_fixture(count: int, max_tokens: int = MAX_TOKENS) -> Any:
    """A module fixture: `greedy_texts` of the tiny llama for ``count`` long chats."""
    import pytest

    @pytest.fixture(scope="module")
    def fixture(tiny_checkpoints: dict[str, str]) -> dict[int, str]:
        return greedy_texts(tiny_checkpoints["llama"], count, max_tokens)
    return fixture


def greedy_texts(model_path: str, count: int, max_tokens: int = MAX_TOKENS) -> dict[int, str]:
    """One engine's greedy answers to `long_conv(i)`: what every served answer must equal."""
    from pdserve.cluster.config import engine_config
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    engine = LLMEngine(engine_config(model_path, num_kv_blocks=256))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompts = [engine.tokenizer.encode(engine.tokenizer.apply_chat_template(long_conv(i)))
               for i in range(count)]
    return {i: engine.tokenizer.decode(out) for i, out in
            enumerate(engine.generate(prompts, params))}


@dataclass(frozen=True)
class Outcome:
    kind: Kind
    detail: str = ""


@dataclass
class RoundResult:
    point: str
    fired: bool
    outcomes: list[Outcome] = field(default_factory=list)

    def count(self, kind: Kind) -> int:
        return sum(1 for o in self.outcomes if o.kind == kind)


def _body(i: int, stream: bool) -> dict[str, Any]:
    return {"model": "tiny", "messages": long_conv(i), "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": stream}


def ask(url: str, i: int, expected: str, stream: bool) -> Outcome:
    """One chat, classified: the greedy text, a clear error (an error body or an in-band
    error event then [DONE]), or anything else (a wrong answer)."""
    path = f"{url}/v1/chat/completions"
    try:
        if not stream:
            r = httpx.post(path, json=_body(i, False), timeout=180)
            if r.status_code == 200:
                text = r.json()["choices"][0]["message"]["content"]
                return Outcome("right") if text == expected else Outcome("wrong", repr(text))
            error = r.json().get("error", {})
            clear = r.status_code in (429, 500, 503, 504) and error.get("message")
            return Outcome("error", f"{r.status_code} {error.get('message')}") if clear \
                else Outcome("wrong", f"{r.status_code} {r.text[:200]}")
        return _ask_streamed(path, i, expected)
    except httpx.HTTPError as exc:  # the ingress never dies in these rounds
        return Outcome("wrong", f"transport: {exc!r}")


def _ask_streamed(path: str, i: int, expected: str) -> Outcome:
    events: list[str] = []
    with httpx.stream("POST", path, json=_body(i, True), timeout=180) as r:
        if r.status_code != 200:
            r.read()
            return Outcome("error", f"{r.status_code}") if r.status_code in (429, 503) \
                else Outcome("wrong", f"{r.status_code} {r.text[:200]}")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return Outcome("wrong", f"no [DONE]: {events[-2:]}")
    chunks = [json.loads(e) for e in events[:-1]]
    errors = [c["error"] for c in chunks if "error" in c]
    if errors:
        return Outcome("error", errors[-1].get("message", "")) if errors[-1].get("message") \
            else Outcome("wrong", f"error event without a message: {errors[-1]}")
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                   if c.get("choices"))
    return Outcome("right") if text == expected else Outcome("wrong", repr(text))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return os.path.exists(f"/proc/{pid}") and \
        open(f"/proc/{pid}/stat").read().split(") ")[1][:1] != "Z"


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def kill_round(served: ServedApps, app: str, point: str, greedy: dict[int, str],
               num_requests: int = 4, on_answer: Callable[[Outcome], None] | None = None
               ) -> RoundResult:
    """Arm ``point`` in the app's one replica of its role, send ``num_requests`` chats at once
    (every other one streamed), classify each; then wait for the replacement replica and for
    every block on every role to be back."""
    from ray import serve

    url = served.url(app)
    role = point.split(".")[0]
    wait_for(lambda: healthy(url) and len(replica_pids(app, role)) == 1, 120,
             f"{app} to be healthy with one {role} replica")
    [pid] = replica_pids(app, role)
    serve.get_deployment_handle(role, app_name=app).arm_fault.remote(point).result(
        timeout_s=30)
    with ThreadPoolExecutor(max_workers=num_requests) as pool:
        futures = [pool.submit(ask, url, i, greedy[i], i % 2 == 1)
                   for i in range(num_requests)]
        outcomes = [f.result(timeout=300) for f in futures]
    if on_answer is not None:
        for outcome in outcomes:
            on_answer(outcome)
    fired = not _alive(pid)
    if not fired:  # the point was never reached: kill it by hand so nothing stays armed
        os.kill(pid, 9)
    wait_for(lambda: not _alive(pid), 30, f"replica {pid} to be gone")
    wait_for(lambda: healthy(url) and len(replica_pids(app, role)) == 1
             and replica_pids(app, role) != [pid], 120, f"a new {role} replica")
    served.wait_all_free(app, timeout_s=60)
    return RoundResult(point, fired, outcomes)
