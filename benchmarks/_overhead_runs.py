"""The two sides of the serving-overhead benchmark: a workload replayed offline through one
`LLMEngine` at its arrival times, and the same workload over HTTP against `pdserve serve`.

Both yield the same figures per request class (output tok/s, TTFT, TPOT), so they compare.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml
from _proc_cpu import role_cpu, session_pids, snapshot

from pdserve.bench.client import Endpoint
from pdserve.bench.records import RequestRecord
from pdserve.bench.runner import LoadSpec, prepare, run_load
from pdserve.bench.workloads import PromptSpec

SERVER_START_S = 300.0  # Ray, Serve and a checkpoint load on a busy 2-core box
SERVER_STOP_S = 90.0  # the drain grace period plus Ray's shutdown


@dataclass(frozen=True)
class Request:
    """One request of a workload: its prompt, class ("short", "long", ...) and arrival time."""

    prompt: PromptSpec
    kind: str
    arrival_s: float


@dataclass
class Sample:
    """What one request showed, offline or served, in seconds."""

    kind: str
    output_tokens: int
    ttft_s: float
    tpot_s: float


@dataclass
class RunResult:
    """One workload through one path: every request's sample and the run's figures."""

    samples: list[Sample]
    duration_s: float
    failed: int = 0
    decode_step_s: float = float("nan")  # offline only: mean decode-only step (see below)
    decode_batch: float = float("nan")  # ...and the mean number of rows in those steps
    notes: list[str] = field(default_factory=list)
    # CPU seconds over the run: offline {"engine": the process}; served, per role
    # (ingress, decode, prefill, proxy) and per worker's engine thread ("decode.engine").
    cpu_s: dict[str, float] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(s.output_tokens for s in self.samples)

    def cpu_us_per_token(self, key: str) -> float:
        return self.cpu_s.get(key, float("nan")) / max(self.num_tokens, 1) * 1e6

    def tok_per_s(self) -> float:
        return sum(s.output_tokens for s in self.samples) / self.duration_s

    def pct(self, metric: str, q: float, kind: str | None = None) -> float:
        values = [getattr(s, metric) for s in self.samples if kind in (None, s.kind)
                  and (metric != "tpot_s" or s.output_tokens > 1)]
        return float(np.percentile(values, q)) if values else float("nan")


def run_offline(engine: Any, requests: Sequence[Request], full_batch: int | None) -> RunResult:
    """Replay the requests at their arrival times through ``engine``, timing each token.

    A decode-only step is one where every row computed a single token; its mean time (over
    the steps at ``full_batch`` rows, when given) is the engine's step time at that batch.
    """
    from pdserve.engine.sampling_params import SamplingParams

    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    cpu_start = os.times()
    stamps: dict[str, list[float]] = {}
    decode_steps: list[tuple[int, float]] = []
    start, added = time.perf_counter(), 0
    while added < len(order) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while added < len(order) and requests[order[added]].arrival_s <= now:
            r = requests[order[added]]
            params = SamplingParams(max_tokens=r.prompt.max_tokens, temperature=0.0,
                                    ignore_eos=True)
            engine.add_request(str(order[added]), list(r.prompt.prompt_ids), params)
            stamps[str(order[added])] = [start + r.arrival_s]
            added += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, requests[order[added]].arrival_s - now))
            continue
        computed, began = engine.stats.num_tokens_computed, time.perf_counter()
        outputs = engine.step()
        ended = time.perf_counter()
        if outputs and engine.stats.num_tokens_computed - computed == len(outputs):
            decode_steps.append((len(outputs), ended - began))
        for out in outputs:
            stamps[out.request_id].extend([ended] * len(out.new_token_ids))
    duration = max(s[-1] for s in stamps.values()) - start
    samples = [_sample(requests[int(rid)].kind, s[0], s[1:]) for rid, s in stamps.items()]
    steps = [(b, t) for b, t in decode_steps if full_batch is None or b == full_batch]
    cpu_end = os.times()
    result = RunResult(samples, duration, cpu_s={"engine": cpu_end.user + cpu_end.system
                                                 - cpu_start.user - cpu_start.system})
    if steps:
        result.decode_step_s = float(np.mean([t for _, t in steps]))
        result.decode_batch = float(np.mean([b for b, _ in steps]))
    return result


def _sample(kind: str, sent: float, token_times: Sequence[float]) -> Sample:
    n = len(token_times)
    tpot = (token_times[-1] - token_times[0]) / (n - 1) if n > 1 else 0.0
    return Sample(kind, n, token_times[0] - sent, tpot)


@dataclass(frozen=True)
class Served:
    """A running `pdserve serve`: its base URL and the session its processes share."""

    url: str
    session_id: int


def run_served(served: Served, model: str, requests: Sequence[Request], label: str
               ) -> RunResult:
    """The requests as streamed `/v1/completions` (token ids) at their arrival times, with
    the CPU time its processes spent meanwhile."""
    endpoint = Endpoint(served.url, model)
    prepared = prepare(endpoint, [r.prompt for r in requests])
    pids = session_pids(served.session_id)
    before = snapshot(pids)
    records, duration = run_load(endpoint, prepared, LoadSpec(), label,
                                 times=[r.arrival_s for r in requests])
    cpu = role_cpu(before, snapshot(pids))
    ok = [r for r in records if r.ok]
    result = RunResult([_served_sample(requests[r.index].kind, r) for r in ok], duration,
                       failed=len(records) - len(ok), cpu_s=cpu)
    result.notes.extend(sorted({r.error or "" for r in records if not r.ok}))
    return result


def _served_sample(kind: str, record: RequestRecord) -> Sample:
    assert record.ttft_s is not None and record.tpot_s is not None
    return Sample(kind, record.output_tokens, record.ttft_s, record.tpot_s)


@contextmanager
def pdserve_serve(config: dict[str, Any], workdir: Path, port: int) -> Iterator[Served]:
    """`pdserve serve` on ``config`` in a session of its own, once /health says every role is
    up. SIGTERM on the way out (drain), the session killed if it lingers."""
    workdir.mkdir(parents=True, exist_ok=True)
    cfg_path, log_path = workdir / "config.yaml", workdir / "serve.log"
    cfg_path.write_text(yaml.safe_dump(config))
    exe = Path(sys.executable).with_name("pdserve")
    with sigterm_exits():
        with log_path.open("w") as log:
            proc = subprocess.Popen([str(exe), "serve", str(cfg_path)], stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(url, proc, log_path)
            yield Served(url, proc.pid)
        finally:
            _stop(proc)


@contextmanager
def sigterm_exits() -> Iterator[None]:
    """While a server runs, SIGTERM to the benchmark raises SystemExit (in the main thread),
    so the server's context manager stops it: the default action would end the benchmark and
    leave the server's session running."""
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pdserve serve exited ({proc.returncode}); see {log_path}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"pdserve serve was not healthy within {SERVER_START_S:.0f} s; "
                       f"see {log_path}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(SERVER_STOP_S)
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # Ray's processes live in the same session
