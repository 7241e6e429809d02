"""What the engine hands out: each step's output per request, where received KV goes, and
snapshots of its KV pool, queues and counters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.kv_tiers import TierStats
from pdserve.engine.logprobs import TokenLogprobs
from pdserve.engine.tiers.cost import KVReuse


@dataclass(frozen=True)
class RequestOutput:
    """What a step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "prefilled" | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    # One per token of new_token_ids when the request asked for logprobs (else empty).
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    queue_s: float = 0.0  # from add_request until the request's first chunk was scheduled
    kv_reuse: KVReuse | None = None  # how the prompt's prefix was reused (first admission)
    # The output token before new_token_ids (-1: they start the output): a reader checks that
    # the tokens continue the ones it has.
    prev_token_id: int = -1


@dataclass(frozen=True)
class ReceivedKVSlots:
    """Where a prompt's received KV goes: ``block_ids`` to be filled by the handoff, after
    the first ``num_cached_tokens`` (whole blocks) this worker already held in its cache."""

    block_ids: list[int]
    num_cached_tokens: int


@dataclass(frozen=True)
class KVStats:
    """A snapshot of the KV pool and queues: what routers balance on and tests assert."""

    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_waiting: int
    num_running: int
    num_awaiting_kv: int
    num_prefilled: int
    num_aborted: int
    num_loading: int = 0
    tiers: TierStats = field(default_factory=TierStats)


@dataclass
class EngineStats:
    num_steps: int = 0
    num_tokens_computed: int = 0  # every token that went through the model
    num_preemptions: int = 0
    num_aborted: int = 0  # live requests stopped from outside (client gone, handoff failed)
