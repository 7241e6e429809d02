"""What the router sends a decode worker, and the events its `generate` stream yields.

Plain frozen dataclasses: Ray carries them between the ingress and the replicas.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pdserve.engine.sampler import TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams


class DecodeCapacityError(RuntimeError):
    """The decode worker could not find room for the prompt's KV before its deadline."""


@dataclass(frozen=True)
class DecodeRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # True: prefill here too (short prompt, colocated mode, or recompute after a failed
    # handoff); False: reserve blocks and wait for a prefill worker's KV.
    local_prefill: bool
    # Output tokens the client already has (recompute fallback): recomputed, not generated.
    resume_output_ids: tuple[int, ...] = ()
    # How often the stream may carry new tokens: the first at once, then at most one event
    # per interval with every token since (0: as they come; None: only the finished event,
    # for a client that reads the whole answer at once).
    stream_interval_s: float | None = 0.0


@dataclass(frozen=True)
class DecodeEvent:
    """One item of a decode stream.

    kind "ticket": blocks are reserved, hand `ticket` to a prefill worker; the decode worker
    already holds the KV of the prompt's first `num_cached_tokens` (whole blocks), which the
    ticket does not cover.
    kind "tokens": new output tokens (and their text); the last one has `finished`.
    kind "handoff_failed": the KV never arrived intact; the reservation is already released.
    """

    kind: Literal["ticket", "tokens", "handoff_failed"]
    ticket: dict[str, Any] | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token, if asked
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    num_output_tokens: int = 0
    # "tokens": prompt tokens this worker's prefix cache saved it computing (0 for received
    # KV); "ticket": prompt tokens whose KV it already holds, so the ticket leaves them out.
    num_cached_tokens: int = 0
    reason: str = ""
    # "handoff_failed": what failed, the error's `HandoffError.code` (timeout, digest, ...).
    error_kind: str = ""
    # Disaggregated path only: seconds from the ticket until the fence verified (this
    # overlaps the prefill), and the KV bytes that arrived.
    handoff_wait_s: float = 0.0
    handoff_bytes: int = 0
