"""Per-request stage timings: one immutable record per request, logged as one JSON line.

Stages fill it in as they finish (`with_`); `PdserveMetrics.observe` exports it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, fields
from typing import Any, Literal

from pdserve.engine.tiers.cost import KVReuse

RequestPath = Literal["disaggregated", "local_prefill", "colocated", "recompute_fallback"]
RequestStatus = Literal["ok", "error", "cancelled", "timeout", "rejected", "stalled"]

REQUEST_PATHS: frozenset[str] = frozenset(
    ("disaggregated", "local_prefill", "colocated", "recompute_fallback"))
REQUEST_STATUSES: frozenset[str] = frozenset(
    ("ok", "error", "cancelled", "timeout", "rejected", "stalled"))
LOG_EVENT = "pdserve.request"


def time_per_output_token_ms(first_token_s: float, last_token_s: float,
                             num_output_tokens: int) -> float | None:
    """Mean gap between output tokens after the first (None with fewer than two tokens)."""
    if num_output_tokens < 2:
        return None
    return (last_token_s - first_token_s) * 1000.0 / (num_output_tokens - 1)


@dataclass(frozen=True)
class RequestTimings:
    """What one request cost, stage by stage. Durations in ms; None: stage did not run.

    ``path``: ``disaggregated`` (prefill worker + KV handoff), ``local_prefill`` (short
    prompt prefilled on the decode worker), ``colocated`` (colocated mode), or
    ``recompute_fallback`` (handoff failed, decode recomputed the prompt); None when the
    request ended before a path was chosen (e.g. rejected). ``fallback_reason`` says why a
    request left its planned path: ``handoff_failed``/``prefill_failed`` (recomputed),
    ``prefill_busy``/``no_prefill_replica`` (a long enough prompt prefilled on decode).
    ``handoff_exposed_ms`` is the part of the handoff that ran after prefill compute ended,
    i.e. what overlap did not hide.
    """

    request_id: str
    path: RequestPath | None = None
    status: RequestStatus = "ok"
    finish_reason: str | None = None
    fallback_reason: str | None = None
    handoff_error: str | None = None  # what failed in a failed handoff (timeout, digest, ...)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    prefix_hit_tokens: int = 0
    # None: every prompt token not served by the prefix cache was computed once.
    prefill_tokens_computed: int | None = None
    tokenize_ms: float | None = None
    decode_reserve_ms: float | None = None
    prefill_queue_ms: float | None = None
    prefill_compute_ms: float | None = None
    handoff_bytes: int | None = None
    handoff_ms: float | None = None
    handoff_exposed_ms: float | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    # Lifecycle events the decode worker's Serve calls carried (tokens go over the token
    # plane): a ticket and the KV's outcome on the disaggregated path, none otherwise.
    num_serve_messages: int = 0
    # KV reuse beyond the device cache: when another tier (``kv_tier``: host, ...) held more
    # of the prompt's prefix, the choice (``load`` or ``recompute``) and both estimates; what
    # was loaded from it, in how long; why a chosen load fell back to compute.
    kv_load_choice: str | None = None
    kv_load_estimate_ms: float | None = None
    kv_compute_estimate_ms: float | None = None
    kv_tier: str | None = None
    kv_loaded_tokens: int = 0
    kv_load_bytes: int = 0
    kv_load_ms: float | None = None
    kv_load_failure: str | None = None
    kv_device_hit_tokens: int = 0
    # The cached prefix (tokens, device or host) the prefix index saw on the chosen replica.
    routed_cached_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.path is not None and self.path not in REQUEST_PATHS:
            raise ValueError(f"path must be one of {sorted(REQUEST_PATHS)} or None, "
                             f"got {self.path!r}")
        if self.status not in REQUEST_STATUSES:
            raise ValueError(f"status must be one of {sorted(REQUEST_STATUSES)}, "
                             f"got {self.status!r}")
        for f in fields(self):
            value = getattr(self, f.name)
            numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
            if numeric and (not math.isfinite(value) or value < 0):
                raise ValueError(f"{f.name} must be a finite number >= 0, got {value}")
        if self.prefix_hit_tokens > self.num_prompt_tokens:
            raise ValueError(f"prefix_hit_tokens ({self.prefix_hit_tokens}) exceeds "
                             f"num_prompt_tokens ({self.num_prompt_tokens})")

    def with_(self, **changes: Any) -> RequestTimings:
        """A copy with some stages filled in (validated again)."""
        return dataclasses.replace(self, **changes)

    @property
    def num_prefill_tokens_computed(self) -> int:
        if self.prefill_tokens_computed is not None:
            return self.prefill_tokens_computed
        return self.num_prompt_tokens - self.prefix_hit_tokens

    def to_log_line(self) -> str:
        """One JSON object on one line; every field present (null when not measured)."""
        record: dict[str, Any] = {"event": LOG_EVENT}
        for f in fields(self):
            value = getattr(self, f.name)
            record[f.name] = round(value, 3) if isinstance(value, float) else value
        record["prefill_tokens_computed"] = self.num_prefill_tokens_computed
        return json.dumps(record, separators=(",", ":"))


def reuse_fields(reuse: KVReuse | None) -> dict[str, Any]:
    """The `RequestTimings` fields of a worker's reuse record."""
    if reuse is None:
        return {}
    decision = reuse.decision
    fields_: dict[str, Any] = {"kv_device_hit_tokens": reuse.num_device_tokens,
                               "kv_loaded_tokens": reuse.num_loaded_tokens,
                               "kv_tier": None if decision is None else decision.tier,
                               "kv_load_failure": reuse.failure,
                               "kv_load_ms": None if reuse.load_s is None
                               else reuse.load_s * 1000.0}
    if decision is not None:
        fields_.update(
            kv_load_choice="load" if decision.load else "recompute",
            kv_load_estimate_ms=None if decision.load_s is None else decision.load_s * 1000.0,
            kv_compute_estimate_ms=(None if decision.compute_s is None
                                    else decision.compute_s * 1000.0),
            kv_load_bytes=decision.num_bytes if reuse.num_loaded_tokens else 0)
    return fields_


class RequestTrace:
    """The request's timings as they fill in; frozen `RequestTimings` underneath."""

    def __init__(self, request_id: str, started: float | None = None) -> None:
        self.started = time.monotonic() if started is None else started
        self.timings = RequestTimings(request_id=request_id)
        # The request's deadline passed while it ran: however it then ended (an error, or a
        # cancellation that reached the task while it was sending), it ended by timing out.
        self.deadline_passed = False

    def update(self, **changes: Any) -> None:
        self.timings = self.timings.with_(**changes)

    def ms_since_start(self) -> float:
        return (time.monotonic() - self.started) * 1000.0
