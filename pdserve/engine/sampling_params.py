"""How one request wants its tokens drawn and when it wants to stop.

Validated once on construction; every error names the field and its allowed range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.grammar_spec import GrammarSpec

# OpenAI's API caps top_logprobs at 20; more would also make the sampler's top-k costly.
MAX_LOGPROBS = 20
# OpenAI's ranges for the penalties and for a logit bias (at most 300 biased tokens).
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_TOKENS = 300
# Seeds as torch takes them (signed or unsigned 64-bit); draws use them modulo 2**64.
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
    token's own logprob; None: no logprobs). ``presence_penalty`` / ``frequency_penalty``
    lower the logits of tokens already generated (once / per occurrence; negative values
    raise them), ``logit_bias`` adds to chosen tokens' logits: all three before temperature,
    top-k and top-p; reported logprobs stay those of the model's raw distribution.
    ``grammar``: the output must follow it; the tokens it does not allow next are masked
    after the penalties and bias, before temperature, top-k and top-p.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids unique
    grammar: GrammarSpec | None = None

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
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= _require_float(name, getattr(self, name)) <= MAX_PENALTY:
                raise InvalidRequestError(
                    f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {getattr(self, name)}")
            object.__setattr__(self, name, float(getattr(self, name)))
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise InvalidRequestError(f"grammar must be a GrammarSpec, got {self.grammar!r}")
        self._normalize_stops()
        self._normalize_logit_bias()

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

    def _normalize_logit_bias(self) -> None:
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        bias = tuple((_require_int("logit_bias token id", t), _require_float("logit_bias", b))
                     for t, b in pairs)
        if len(bias) > MAX_LOGIT_BIAS_TOKENS:
            raise InvalidRequestError(
                f"logit_bias may name at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(bias)}")
        if len({t for t, _ in bias}) != len(bias):
            raise InvalidRequestError("logit_bias names a token id twice")
        for token_id, value in bias:
            if token_id < 0 or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise InvalidRequestError(
                    f"logit_bias needs token ids >= 0 and biases in [-{MAX_LOGIT_BIAS}, "
                    f"{MAX_LOGIT_BIAS}], got {token_id}: {value}")
        object.__setattr__(self, "logit_bias", bias)

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler must change this request's logits before drawing."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy with nothing else to compute: the token is the raw logits' argmax."""
        return (self.temperature == 0.0 and self.logprobs is None and not self.adjusts_logits
                and self.grammar is None)
