"""What the router sends a prefill worker and what it answers.

The answer carries the first token: the router shows it before the KV handoff completes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.engine.sampler import TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class PrefillRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    ticket: dict[str, Any]  # HandoffTicket.to_dict() from the paired decode worker
    # Prompt tokens whose KV the decode worker already holds (whole blocks): the ticket's
    # blocks start after them.
    decode_cached_tokens: int = 0


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    first_token_id: int
    first_text: str
    num_cached_tokens: int  # prompt tokens served from this worker's prefix cache
    num_computed_tokens: int  # prompt tokens this worker actually ran through the model
    queue_s: float  # from arrival at the worker until its first chunk was scheduled
    compute_s: float  # from the first scheduled chunk until the first token was sampled
    first_logprobs: TokenLogprobs | None = None  # when the request asked for logprobs
