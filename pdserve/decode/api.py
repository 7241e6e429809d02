"""What the ingress sends a decode worker, and the lifecycle events its `generate` call yields.

Tokens do not travel here: they go over the token plane (`token_wire.py`) to ``sink``. A
`generate` call yields at most two events (a disaggregated request's ticket, then its KV's
outcome) and ends when the request does; cancelling it stops the request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.engine.sampling_params import SamplingParams
from pdserve.planes.token_wire import TokenSink


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
    sink: TokenSink  # the ingress replica's token plane: where the tokens go
    # Output tokens the client already has (recompute fallback): recomputed, not generated.
    resume_output_ids: tuple[int, ...] = ()
    # The decode replicas best first, when the decode policy ranks by cached prefix.
    replica_ranking: tuple[str, ...] = ()


@dataclass(frozen=True)
class KVTicket:
    """Blocks are reserved: hand ``ticket`` to a prefill worker. The decode worker already
    holds the KV of the prompt's first ``num_cached_tokens`` (whole blocks), which the ticket
    does not cover."""

    ticket: dict[str, Any]
    num_cached_tokens: int


@dataclass(frozen=True)
class KVArrived:
    """The KV's fence verified and the request joined the batch: seconds from the ticket
    until then (overlapping the prefill), and the bytes that arrived."""

    handoff_wait_s: float
    handoff_bytes: int


@dataclass(frozen=True)
class HandoffFailed:
    """The KV never arrived intact; the reservation is already released. ``code`` names
    why (timeout, digest, peer_gone, ...)."""

    reason: str
    code: str


DecodeEvent = KVTicket | KVArrived | HandoffFailed
