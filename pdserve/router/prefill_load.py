"""When a prompt should skip the prefill role: the prompt tokens queued there against its own.

Prefilling a short prompt on its decode worker costs that worker about as long as the
prompt is; waiting at a busy prefill role costs everything queued ahead of it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LocalPrefillPolicy:
    # Longer prompts always go to the prefill role: prefilling them on decode would stall
    # every stream decoding there for as long.
    max_local_tokens: int
    # Prefill locally when the prefill role has more than this many times the prompt's
    # own tokens queued per replica (0: never by load).
    queue_factor: float


class PrefillLoad:
    """Prompt tokens this ingress has sent to prefill replicas that have not returned their
    first token yet, next to what the replicas last reported of their queues."""

    def __init__(self, policy: LocalPrefillPolicy) -> None:
        self.policy = policy
        self.num_in_flight_tokens = 0
        self.num_reported_tokens = 0  # queued on the prefill replicas, from their last report
        self.num_replicas = 1

    def begin(self, num_tokens: int) -> None:
        self.num_in_flight_tokens += num_tokens

    def end(self, num_tokens: int) -> None:
        self.num_in_flight_tokens -= num_tokens

    def report(self, num_queued_tokens: int, num_replicas: int) -> None:
        self.num_reported_tokens = num_queued_tokens
        self.num_replicas = max(1, num_replicas)

    def queued_per_replica(self) -> float:
        # Other ingress replicas' prompts show only in the reports; ours show at once.
        return max(self.num_in_flight_tokens, self.num_reported_tokens) / self.num_replicas

    def prefill_here(self, num_tokens: int) -> bool:
        """Whether a prompt of ``num_tokens`` would wait longer at the prefill role than its
        decode worker takes to prefill it."""
        policy = self.policy
        if policy.queue_factor <= 0 or num_tokens > policy.max_local_tokens:
            return False
        return self.queued_per_replica() > policy.queue_factor * num_tokens
