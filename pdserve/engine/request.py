"""The scheduler's mutable record of one request: its tokens, progress and status.

Only the scheduler mutates it; runners and workers read it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tiers.cost import KVReuse


class RequestMode(Enum):
    """Which part of the work this engine does for the request."""

    FULL = "full"  # prefill and decode here (colocated, or decode's local-prefill fallback)
    PREFILL_ONLY = "prefill_only"  # prefill role: compute the prompt, sample token 1, pin KV
    FROM_RECEIVED_KV = "from_received_kv"  # decode role: prompt KV arrives over the handoff


class RequestStatus(Enum):
    WAITING = "waiting"  # queued (new or preempted); owns no blocks
    RUNNING = "running"  # owns blocks; scheduled every step until done
    AWAITING_KV = "awaiting_kv"  # decode role: blocks reserved, KV in flight, not scheduled
    LOADING_KV = "loading_kv"  # a prefix's KV is copied in from another tier; not scheduled
    PREFILLED = "prefilled"  # prefill role: prompt done, blocks pinned until release()
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI ``finish_reason`` of a finished status, None otherwise."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)  # identity semantics: two requests are never "equal"
class Request:
    """One request's tokens and progress.

    ``num_computed_tokens`` counts tokens whose KV is in the cache. The newest output token
    never has KV yet: it is computed by the step that samples the next one, so a decoding
    request has ``num_computed_tokens == num_tokens - 1``.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    mode: RequestMode = RequestMode.FULL
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens reused (any tier) at the first schedule
    kv_reuse: KVReuse | None = None  # set at the first admission
    skip_tier_loads: bool = False  # a load from another tier failed: compute instead
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidRequestError(
                f"request_id must be a non-empty string, got {self.request_id!r}"
            )
        if not self.prompt_token_ids:
            raise InvalidRequestError(f"request {self.request_id}: the prompt has no tokens")
        # Copies: the caller's lists must not alias the scheduler's state.
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.output_token_ids = list(self.output_token_ids)
        self.eos_token_ids = tuple(self.eos_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_id(self, position: int) -> int:
        """Token ``position`` of prompt+output."""
        num_prompt = len(self.prompt_token_ids)
        if position < num_prompt:
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - num_prompt]

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt+output without building the whole list."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def set_finished(self, status: RequestStatus) -> None:
        if not status.is_finished:
            raise ValueError(f"set_finished needs a FINISHED_* status, got {status}")
        self.status = status
        self.finish_reason = status.finish_reason
