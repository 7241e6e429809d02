"""What KV reuse bought a long-doc run: each document's first request against its repeats
(TTFT, prompt tokens computed), the reuse ratio, and where reused KV came from, from the
server's per-request timings (`--server-timings`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.bench.metrics import percentile
from pdserve.bench.records import RequestRecord, RunResult


@dataclass(frozen=True)
class ReuseSummary:
    num_first: int
    num_repeat: int
    first_ttft_p50_ms: float | None
    first_ttft_p90_ms: float | None
    repeat_ttft_p50_ms: float | None
    repeat_ttft_p90_ms: float | None
    first_computed_per_request: float | None  # prompt tokens computed, mean
    repeat_computed_per_request: float | None
    repeat_computed_fraction: float | None  # of the repeats' prompt tokens
    reuse_ratio: float | None  # reused / prompt tokens over the whole run
    loads_by_tier: dict[str, int]  # requests that loaded KV, by the tier it came from

    @property
    def ttft_ratio(self) -> float | None:
        if not self.first_ttft_p50_ms or self.repeat_ttft_p50_ms is None:
            return None
        return self.repeat_ttft_p50_ms / self.first_ttft_p50_ms

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "ttft_ratio": self.ttft_ratio}


def _ms(values: Sequence[float], q: float) -> float | None:
    return percentile(values, q) * 1000.0 if values else None


def _computed(record: RequestRecord) -> int | None:
    """Prompt tokens the server computed: what the prefill worker reports, or (the colocated
    path, which reports none) the prompt less its reused prefix."""
    if not record.server_timings:
        return None
    t = record.server_timings[0]
    value = t.get("prefill_tokens_computed")
    if value is None and t.get("prefix_hit_tokens") is not None:
        value = record.prompt_tokens - int(t["prefix_hit_tokens"])
    return None if value is None else int(value)


def summarize_reuse(run: RunResult) -> ReuseSummary | None:
    """None unless the run was long-doc with several documents."""
    documents = int(run.workload.get("num_documents") or 1)
    if run.workload.get("name") != "long-doc":
        return None
    ok = [r for r in run.records if r.ok and r.ttft_s is not None]
    first = [r for r in ok if r.index < documents]
    repeat = [r for r in ok if r.index >= documents]

    def mean_computed(records: list[RequestRecord]) -> float | None:
        values = [c for r in records if (c := _computed(r)) is not None]
        return sum(values) / len(values) if values else None

    timed = [r for r in ok if r.server_timings]
    prompt = sum(r.prompt_tokens for r in timed)
    reused = sum(int(r.server_timings[0].get("prefix_hit_tokens") or 0) for r in timed)
    repeat_prompt = sum(r.prompt_tokens for r in repeat if _computed(r) is not None)
    repeat_computed = sum(c for r in repeat if (c := _computed(r)) is not None)
    tiers = Counter(str(r.server_timings[0].get("kv_tier")) for r in timed
                    if r.server_timings[0].get("kv_loaded_tokens"))
    return ReuseSummary(
        len(first), len(repeat),
        _ms([r.ttft_s for r in first if r.ttft_s is not None], 50),
        _ms([r.ttft_s for r in first if r.ttft_s is not None], 90),
        _ms([r.ttft_s for r in repeat if r.ttft_s is not None], 50),
        _ms([r.ttft_s for r in repeat if r.ttft_s is not None], 90),
        mean_computed(first), mean_computed(repeat),
        repeat_computed / repeat_prompt if repeat_prompt else None,
        reused / prompt if prompt else None, dict(tiers))
