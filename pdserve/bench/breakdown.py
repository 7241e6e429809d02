"""The server's per-request stage timings joined to the client's figures: where a request's
time went, and what its KV handoff cost.

A request's client-side E2E splits into consecutive stages (ms): tokenize, decode reserve,
prefill queue, prefill compute, the rest of the first token (local prefill in colocated mode,
Serve hops), the handoff left exposed after prefill, decode, and what the client saw beyond
the server's own E2E (proxy, network, SSE parsing).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.bench.metrics import percentile
from pdserve.bench.records import RequestRecord

# (stage, label for plots and tables)
STAGES = (
    ("tokenize", "tokenize"),
    ("decode_reserve", "decode reserve"),
    ("prefill_queue", "prefill queue"),
    ("prefill_compute", "prefill compute"),
    ("first_token_other", "first token, other"),
    ("handoff_exposed", "handoff exposed"),
    ("decode", "decode"),
    ("client_overhead", "client/proxy"),
)


def _ms(timings: Mapping[str, Any], key: str) -> float:
    value = timings.get(key)
    return float(value) if isinstance(value, (int, float)) else 0.0


def request_stages(record: RequestRecord) -> dict[str, float] | None:
    """The stages of one successful request with server timings (its first choice); None
    without them (another server, or a failed request)."""
    if not record.ok or not record.server_timings or record.e2e_s is None:
        return None
    t = record.server_timings[0]
    if t.get("ttft_ms") is None or t.get("e2e_ms") is None:
        return None
    before_first = {k: _ms(t, f"{k}_ms") for k in
                    ("tokenize", "decode_reserve", "prefill_queue", "prefill_compute")}
    ttft, e2e, exposed = _ms(t, "ttft_ms"), _ms(t, "e2e_ms"), _ms(t, "handoff_exposed_ms")
    return {**before_first,
            "first_token_other": max(0.0, ttft - sum(before_first.values())),
            "handoff_exposed": exposed,
            "decode": max(0.0, e2e - ttft - exposed),
            "client_overhead": max(0.0, record.e2e_s * 1e3 - e2e)}


@dataclass(frozen=True)
class Breakdown:
    """Mean stage times over the requests that carried server timings, and handoff figures."""

    num_requests: int  # requests with server timings
    mean_ms: dict[str, float]
    paths: dict[str, int]  # request path (disaggregated, local_prefill, ...) -> count
    handoff_ms: tuple[float, ...]
    handoff_bytes: tuple[int, ...]
    prefix_hit_tokens: int
    prompt_tokens: int

    @property
    def handoff_p50_ms(self) -> float:
        return percentile(self.handoff_ms, 50)

    @property
    def handoff_p99_ms(self) -> float:
        return percentile(self.handoff_ms, 99)

    @property
    def total_handoff_mib(self) -> float:
        return sum(self.handoff_bytes) / 2 ** 20

    def to_json(self) -> dict[str, Any]:
        return {"num_requests": self.num_requests, "mean_ms": self.mean_ms, "paths": self.paths,
                "handoffs": len(self.handoff_ms), "handoff_p50_ms": self.handoff_p50_ms,
                "handoff_p99_ms": self.handoff_p99_ms, "total_handoff_mib": self.total_handoff_mib,
                "prefix_hit_tokens": self.prefix_hit_tokens, "prompt_tokens": self.prompt_tokens}


def breakdown(records: Sequence[RequestRecord]) -> Breakdown | None:
    """None when no request carried server timings (the report then has no breakdown)."""
    stages = [(r, s) for r in records if (s := request_stages(r)) is not None]
    if not stages:
        return None
    paths: dict[str, int] = {}
    handoff_ms, handoff_bytes = [], []
    hits = prompt = 0
    for record, _ in stages:
        t = record.server_timings[0]
        path = str(t.get("path"))
        paths[path] = paths.get(path, 0) + 1
        if t.get("handoff_ms") is not None:
            handoff_ms.append(float(t["handoff_ms"]))
        if t.get("handoff_bytes") is not None:
            handoff_bytes.append(int(t["handoff_bytes"]))
        hits += int(t.get("prefix_hit_tokens") or 0)
        prompt += int(t.get("num_prompt_tokens") or 0)
    mean = {name: sum(s[name] for _, s in stages) / len(stages) for name, _ in STAGES}
    return Breakdown(len(stages), mean, paths, tuple(handoff_ms), tuple(handoff_bytes), hits,
                     prompt)
