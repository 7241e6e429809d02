"""A sampled token's log-probabilities as the engine reports them: a torch-free record, so
the ingress that renders them loads none of the model's code."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities for one sampled token, from the model's raw distribution
    (before temperature, top-k and top-p), as OpenAI's ``logprobs`` reports them."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the `logprobs` most likely (token_id, logprob), best first
