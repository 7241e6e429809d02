"""The scheduler's configuration and the per-step plan it hands to the model runner.

Frozen records with validation and small derived values, and the builder of one step's plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.request import Request


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Limits of one scheduling step, taken from the `EngineConfig` (the config schema checks
    them; ``max_model_len`` is derived by `kv/cache.py` `max_model_len_for`).

    ``max_num_batched_tokens``: token budget per step (prefill chunks + decodes).
    ``max_num_seqs``: requests holding a batch seat (running + awaiting received KV).
    ``max_model_len``: longest sequence (prompt + output); generation stops there.
    ``long_prefill_token_threshold``: cap on one request's chunk per step (0 = none), so a
    long prompt cannot take the whole budget and stall the decodes for a step.
    ``decode_prompt_tokens_per_step``: cap on all prompt tokens of a step that has decoding
    rows (0 = none), shrunk while such steps run past ``decode_step_bound_s``
    (`prompt_allowance.py`).
    """

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    long_prefill_token_threshold: int
    decode_prompt_tokens_per_step: int
    decode_step_bound_s: float


@dataclass(frozen=True)
class ScheduledChunk:
    """Compute KV for tokens ``[start_position, start_position + num_new_tokens)``.

    ``samples``: after this chunk the request has computed all its tokens, so the runner
    must sample its next token from the chunk's last position.
    """

    request: Request
    num_new_tokens: int
    start_position: int
    samples: bool

    @property
    def end_position(self) -> int:
        return self.start_position + self.num_new_tokens

    def token_ids(self) -> list[int]:
        """The input tokens of this chunk."""
        return self.request.token_ids_slice(self.start_position, self.end_position)


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan. Running requests come first, then newly admitted ones."""

    chunks: list[ScheduledChunk]
    num_batched_tokens: int
    preempted_request_ids: list[str]

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class StepPlan:
    """A step's plan while the scheduler builds it; `output` freezes it."""

    budget: int  # tokens still to hand out
    chunks: list[ScheduledChunk] = field(default_factory=list)
    planned: set[str] = field(default_factory=set)  # ids of the requests with a chunk
    preempted_ids: list[str] = field(default_factory=list)

    def add(self, chunk: ScheduledChunk) -> None:
        self.chunks.append(chunk)
        self.planned.add(chunk.request.request_id)
        self.budget -= chunk.num_new_tokens

    def output(self, max_num_batched_tokens: int) -> SchedulerOutput:
        return SchedulerOutput(
            chunks=self.chunks,
            num_batched_tokens=max_num_batched_tokens - self.budget,
            preempted_request_ids=self.preempted_ids,
        )
