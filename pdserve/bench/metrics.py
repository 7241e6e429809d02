"""The figures of one run: TTFT, TPOT, ITL and E2E percentiles, throughput, SLO goodput.

Definitions follow `vllm bench serve`: throughput over the run's wall time; goodput counts
requests that succeeded within every SLO bound, per second of that same time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from pdserve.bench.records import RequestRecord
from pdserve.bench.slo import SLO

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear interpolation between order statistics (numpy's
    default); NaN for no values."""
    if not values:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=float), q))


@dataclass(frozen=True)
class LatencyStats:
    """Mean and percentiles of one latency, in ms; NaN when no request had it."""

    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    count: int

    @classmethod
    def of(cls, seconds: Iterable[float]) -> LatencyStats:
        values = [s * 1e3 for s in seconds]
        mean = float(np.mean(values)) if values else math.nan
        p50, p90, p99 = (percentile(values, q) for q in PERCENTILES)
        return cls(mean, p50, p90, p99, len(values))


@dataclass(frozen=True)
class RunSummary:
    """Everything the report prints about one run."""

    num_requests: int
    completed: int
    failed: int
    errors: dict[str, int]  # kind of error ("HTTP 429", "ReadTimeout", ...) -> count
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats
    slo: dict[str, float | None]
    num_good: int | None  # None: no SLO given
    request_goodput: float | None  # good requests / s
    slo_attainment: float | None  # good / all requests (failures count as misses)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SLO) -> RunSummary:
    """The run's figures; failed requests count in `failed` and as SLO misses, never dropped."""
    ok = [r for r in records if r.ok]
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = (r.error or "unknown error").split(": ", 1)[0]  # details stay in the JSON
            errors[key] = errors.get(key, 0) + 1
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: math.nan)
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    num_good = None if slo.is_empty else sum(slo.is_met_by(r) for r in records)
    return RunSummary(
        num_requests=len(records), completed=len(ok), failed=len(records) - len(ok),
        errors=dict(sorted(errors.items(), key=lambda kv: -kv[1])), duration_s=duration_s,
        total_input_tokens=input_tokens, total_output_tokens=output_tokens,
        request_throughput=per_s(len(ok)), output_throughput=per_s(output_tokens),
        total_token_throughput=per_s(input_tokens + output_tokens),
        ttft=LatencyStats.of(r.ttft_s for r in ok if r.ttft_s is not None),
        # Like vllm: TPOT percentiles over answers of 2+ tokens; goodput treats 1 token as 0.
        tpot=LatencyStats.of(r.tpot_s for r in ok if r.tpot_s is not None
                             and r.output_tokens > 1),
        itl=LatencyStats.of(gap for r in ok for gap in r.itl_s),
        e2el=LatencyStats.of(r.e2e_s for r in ok if r.e2e_s is not None),
        slo=slo.as_dict(), num_good=num_good,
        request_goodput=None if num_good is None else per_s(num_good),
        slo_attainment=None if num_good is None or not records else num_good / len(records),
    )
