"""When a prompt should skip the prefill role: the prompt tokens queued there against its own.

Prefilling a short prompt on its decode worker costs that worker about as long as the
prompt is; waiting at a busy prefill role costs everything queued ahead of it. A long prompt
prefills on decode only where decode has step time to lend (its reports say how much: none
without engine.decode_prompt_tokens_per_step), one per decode replica at a time.
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
        self.num_decode_replicas = 1
        self.num_local_long = 0  # long prompts this ingress has prefilling on decode
        # The decode replica with the most to lend: its tokens/s within its TPOT bound, and
        # a prompt token's cost (the prefill role's workers compute alike).
        self.lend_tokens_per_s = 0
        self.prompt_token_s = 0.0

    def lend_begin(self) -> None:
        """A long prompt went to decode; it holds its replica's turn until `lend_end`."""
        self.num_local_long += 1

    def lend_end(self) -> None:
        self.num_local_long -= 1

    def begin(self, num_tokens: int) -> None:
        self.num_in_flight_tokens += num_tokens

    def end(self, num_tokens: int) -> None:
        self.num_in_flight_tokens -= num_tokens

    def report(self, num_queued_tokens: int, num_replicas: int) -> None:
        self.num_reported_tokens = num_queued_tokens
        self.num_replicas = max(1, num_replicas)

    def report_decode(self, num_replicas: int, lend_tokens_per_s: int,
                      prompt_token_us: int) -> None:
        """The decode role's count, and its best lender's rate and token cost."""
        self.num_decode_replicas = max(1, num_replicas)
        self.lend_tokens_per_s = lend_tokens_per_s
        self.prompt_token_s = prompt_token_us / 1e6

    def queued_per_replica(self) -> float:
        # Other ingress replicas' prompts show only in the reports; ours show at once.
        return max(self.num_in_flight_tokens, self.num_reported_tokens) / self.num_replicas

    def prefill_here(self, num_tokens: int) -> str | None:
        """Why a prompt of ``num_tokens`` prefills on its decode worker ("prefill_busy", or
        "prefill_busy_long" for a long one), or None: it goes to the prefill role."""
        policy = self.policy
        if policy.queue_factor <= 0:
            return None
        if num_tokens <= policy.max_local_tokens:
            busy = self.queued_per_replica() > policy.queue_factor * num_tokens
            return "prefill_busy" if busy else None
        if self.num_local_long >= self.num_decode_replicas or self.lend_tokens_per_s <= 0:
            return None
        # Decode takes it in capped chunks at its lending rate; the prefill role after all
        # that is queued there, at full speed.
        on_decode_s = num_tokens / self.lend_tokens_per_s
        at_prefill_s = (self.queued_per_replica() + num_tokens) * self.prompt_token_s
        return "prefill_busy_long" if on_decode_s < at_prefill_s else None
