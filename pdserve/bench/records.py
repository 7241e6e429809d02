"""What a benchmark run keeps: one record per request, the run around them, and their JSON.

Times are seconds; a request's times count from the moment its HTTP request was sent.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

RUN_FILE_SUFFIX = ".run.json"


@dataclass(frozen=True)
class RequestRecord:
    """One request as the client saw it, plus the server's stage timings when it sent them.

    ``ttft_s``: when the first chunk with a choice arrived, counted from the send;
    ``chunk_times_s``: when each chunk that carried generated text arrived. ``output_tokens``
    comes from the usage chunk (the number of text chunks when the server sent no usage).
    """

    index: int
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    error: str | None = None
    scheduled_s: float = 0.0  # arrival time, from the start of the run
    sent_s: float = 0.0  # when the client sent it (later than scheduled when capped)
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_times_s: tuple[float, ...] = ()
    server_timings: tuple[Mapping[str, Any], ...] = ()

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1), vllm's definition; 0 for a one-token answer."""
        if not self.ok or self.ttft_s is None or self.e2e_s is None:
            return None
        if self.output_tokens <= 1:
            return 0.0
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itl_s(self) -> tuple[float, ...]:
        """Gaps between successive text chunks (a chunk may carry several tokens)."""
        times = self.chunk_times_s
        return tuple(b - a for a, b in zip(times, times[1:], strict=False))

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["chunk_times_s"] = list(self.chunk_times_s)
        data["server_timings"] = [dict(t) for t in self.server_timings]
        data["tpot_s"] = self.tpot_s
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RequestRecord:
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        values["chunk_times_s"] = tuple(values.get("chunk_times_s", ()))
        values["server_timings"] = tuple(values.get("server_timings", ()))
        return cls(**values)


@dataclass(frozen=True)
class RunResult:
    """One load at one rate against one setup: what was asked, and every request's figures."""

    setup: str  # label of the server setup, e.g. the config's name
    workload: Mapping[str, Any]  # name, lengths, seed, scale, ...
    load: Mapping[str, Any]  # request_rate, burstiness, max_concurrency, seed
    slo: Mapping[str, float | None]
    duration_s: float
    records: tuple[RequestRecord, ...]
    server: Mapping[str, Any] = field(default_factory=dict)  # base URL, model, pdserve config
    started_at: float = 0.0  # wall clock (time.time) when the load began
    # The client machine's 1-minute load average when the run began and ended: other jobs on
    # a shared machine show here.
    load_average: tuple[float, float] = (0.0, 0.0)

    @property
    def request_rate(self) -> float:
        return float(self.load.get("request_rate", math.inf))

    def file_name(self) -> str:
        rate = "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}"
        return f"{self.setup}__{self.workload['name']}__rate{rate}{RUN_FILE_SUFFIX}"

    def to_json(self) -> dict[str, Any]:
        return {"setup": self.setup, "workload": dict(self.workload), "load": dict(self.load),
                "slo": dict(self.slo), "duration_s": self.duration_s,
                "server": dict(self.server), "started_at": self.started_at,
                "load_average": list(self.load_average),
                "requests": [r.to_json() for r in self.records]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunResult:
        return cls(setup=data["setup"], workload=data["workload"], load=data["load"],
                   slo=data["slo"], duration_s=data["duration_s"],
                   records=tuple(RequestRecord.from_json(r) for r in data["requests"]),
                   server=data.get("server", {}), started_at=data.get("started_at", 0.0),
                   load_average=tuple(data.get("load_average", (0.0, 0.0))))


def _json_safe(value: Any) -> Any:
    """inf and NaN become strings/null: strict JSON readers refuse them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def _json_restore(value: Any) -> Any:
    if value in ("inf", "-inf"):
        return float(value)
    if isinstance(value, dict):
        return {k: _json_restore(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_restore(v) for v in value]
    return value


def save_run(result: RunResult, result_dir: Path, summary: Mapping[str, Any]) -> Path:
    """Write one run (with its summary, for readers who skip the per-request list)."""
    result_dir.mkdir(parents=True, exist_ok=True)
    path = result_dir / result.file_name()
    payload = {"summary": dict(summary), **result.to_json()}
    path.write_text(json.dumps(_json_safe(payload), indent=1) + "\n")
    return path


def load_runs(result_dir: Path) -> list[RunResult]:
    """Every run saved in a result directory, in file-name order."""
    paths = sorted(result_dir.glob(f"*{RUN_FILE_SUFFIX}"))
    return [RunResult.from_json(_json_restore(json.loads(p.read_text()))) for p in paths]
