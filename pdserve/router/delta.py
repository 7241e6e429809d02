"""What a generation hands the ingress as it goes: new tokens and their text, and its finish.

Built from the token plane's entries (`token_plane.merge_entries`) or a prefill's first token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.logprobs import TokenLogprobs
from pdserve.engine.tiers.cost import KVReuse


@dataclass(frozen=True)
class GenerationDelta:
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token, if asked
    kv_reuse: KVReuse | None = None  # how the prompt's prefix was reused (first delta)
