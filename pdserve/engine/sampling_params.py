"""How one request wants its tokens drawn and when it wants to stop.

Validated once on construction; every error names the field and its allowed range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pdserve.engine.errors import InvalidRequestError

# OpenAI's API caps top_logprobs at 20; more would also make the sampler's top-k costly.
MAX_LOGPROBS = 20
# torch.Generator.manual_seed accepts exactly this range.
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1


def _require_int(name: str, value: Any) -> int:
    # bool is an int subclass; `max_tokens=True` is a client bug, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}")
    return value


def _require_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping settings of one request.

    ``temperature == 0`` means greedy (argmax); ``top_k == 0`` and ``top_p == 1`` mean off.
    ``stop`` strings are matched by the detokenizing layer above the scheduler, which then
    calls ``Scheduler.finish_request``; ``stop_token_ids`` apply even with ``ignore_eos``.
    ``logprobs``: how many top alternatives to return per token (0: only the sampled
    token's own logprob; None: no logprobs).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if _require_int("max_tokens", self.max_tokens) < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if _require_float("temperature", self.temperature) < 0:
            raise InvalidRequestError(
                f"temperature must be >= 0 (0 = greedy), got {self.temperature}"
            )
        top_p = _require_float("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if _require_int("top_k", self.top_k) < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.seed is not None and not MIN_SEED <= _require_int("seed", self.seed) <= MAX_SEED:
            raise InvalidRequestError(f"seed must be in [{MIN_SEED}, {MAX_SEED}], got {self.seed}")
        if (
            self.logprobs is not None
            and not 0 <= _require_int("logprobs", self.logprobs) <= MAX_LOGPROBS
        ):
            raise InvalidRequestError(
                f"logprobs must be in [0, {MAX_LOGPROBS}] or None, got {self.logprobs}"
            )
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        self._normalize_stops()

    def _normalize_stops(self) -> None:
        # Edges hand us lists (JSON) or a bare string (OpenAI allows `stop: "x"`); store tuples
        # so the record stays hashable and immutable.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        for s in stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError(f"stop must hold non-empty strings, got {s!r}")
        stop_token_ids = tuple(self.stop_token_ids)
        for t in stop_token_ids:
            if _require_int("stop_token_ids", t) < 0:
                raise InvalidRequestError(f"stop_token_ids must be >= 0, got {t}")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", stop_token_ids)
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
