"""What the router sends a prefill worker and what it answers.

The answer carries the first token: the router shows it before the KV handoff completes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.engine.logprobs import TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tiers.cost import KVReuse
from pdserve.replica import PrefillQueue


@dataclass(frozen=True)
class PrefillRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    ticket: dict[str, Any]  # HandoffTicket.to_dict() from the paired decode worker
    # Prompt tokens whose KV the decode worker already holds (whole blocks): the ticket's
    # blocks start after them.
    decode_cached_tokens: int = 0
    # The prefill replicas best first (ingress's prefix index and loads): the role's request
    # router follows it.
    replica_ranking: tuple[str, ...] = ()
    # (replica id, leading prompt blocks its device cache holds) for the prefill replicas
    # that hold any (the ingress's prefix index): a longer prefix than the chosen replica's
    # may be pulled from one of them (engine.peer_kv_pull).
    peer_prefixes: tuple[tuple[str, int], ...] = ()


def first_block_to_send(request: PrefillRequest, ticket_num_tokens: int, block_size: int) -> int:
    """The first of the prefill worker's blocks to send: the decode worker holds the ones
    before (whole blocks), and the ticket must cover exactly the rest of the prompt."""
    cached = request.decode_cached_tokens
    if cached < 0 or cached % block_size or cached + ticket_num_tokens != len(
            request.prompt_token_ids):
        raise ValueError(
            f"{request.request_id}: the decode worker holds {cached} prompt tokens and "
            f"reserved {ticket_num_tokens} more, the prompt has "
            f"{len(request.prompt_token_ids)} (block size {block_size})")
    return cached // block_size


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    first_token_id: int
    first_text: str
    num_cached_tokens: int  # prompt tokens served from this worker's prefix cache
    num_computed_tokens: int  # prompt tokens this worker actually ran through the model
    queue_s: float  # from arrival at the worker until its first chunk was scheduled
    compute_s: float  # from the first scheduled chunk until the first token was sampled
    # The worker that answered and its queue as it answered: fresher than its last load
    # report, which can still count this very prompt as queued.
    replica_id: str
    queue: PrefillQueue
    first_logprobs: TokenLogprobs | None = None  # when the request asked for logprobs
    kv_reuse: KVReuse | None = None  # how the prompt's prefix was reused, by tier
