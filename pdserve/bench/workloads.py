"""Synthetic, seeded workloads with token-exact lengths: chat, long-doc, code and random.

Prompts are token ids drawn from the served model's vocabulary (special tokens left out), so a
prompt sent to /v1/completions as ids is exactly as long as drawn. ``--scale`` multiplies every
length (long documents shrink to what a CPU serves in seconds).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    from pdserve.engine.tokenizer import Tokenizer

WorkloadName = Literal["chat", "long-doc", "code", "random"]
WORKLOADS: tuple[WorkloadName, ...] = ("chat", "long-doc", "code", "random")


@dataclass(frozen=True)
class LogNormalLengths:
    """Lengths drawn from a log-normal with this mean (in tokens), clipped to [low, high]."""

    mean: float
    sigma: float
    low: int
    high: int

    def draw(self, rng: np.random.Generator, count: int, scale: float) -> list[int]:
        # exp(mu + sigma^2 / 2) is the log-normal's mean.
        mu = np.log(self.mean * scale) - self.sigma ** 2 / 2
        values = rng.lognormal(mu, self.sigma, size=count)
        low, high = _scaled(self.low, scale), _scaled(self.high, scale)
        return np.clip(np.rint(values), low, max(low, high)).astype(int).tolist()


# ShareGPT-like conversations: long-tailed, ~750 tokens in and ~200 out on average.
CHAT_INPUT = LogNormalLengths(mean=750, sigma=0.9, low=8, high=3072)
CHAT_OUTPUT = LogNormalLengths(mean=200, sigma=0.8, low=4, high=1024)
# Code completion: a short context, a short answer wanted fast.
CODE_INPUT = LogNormalLengths(mean=180, sigma=0.5, low=32, high=512)
CODE_OUTPUT = LogNormalLengths(mean=48, sigma=0.5, low=8, high=192)
# A long document most of which every request shares (its questions differ at the end).
LONG_DOC_TOKENS, LONG_DOC_SHARED, LONG_DOC_OUTPUT = 8192, 6144, 256
RANDOM_INPUT, RANDOM_OUTPUT = 1024, 128


def _scaled(length: int, scale: float) -> int:
    return max(1, round(length * scale))


@dataclass(frozen=True)
class TokenSpace:
    """The token ids prompts are drawn from: the vocabulary without special tokens."""

    vocab_size: int
    excluded_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if self.vocab_size - len(self.excluded_ids) < 2:
            raise ValueError(f"a vocabulary of {self.vocab_size} ids leaves no ids to draw")

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> TokenSpace:
        named = (tokenizer.token_to_id(t) for t in tokenizer.special_tokens.values())
        special = {i for i in named if i is not None} | set(tokenizer.eos_token_ids)
        return cls(tokenizer.vocab_size, frozenset(special))

    def draw(self, rng: np.random.Generator, count: int) -> list[int]:
        allowed = self._allowed()
        return allowed[rng.integers(0, len(allowed), size=count)].tolist()

    def _allowed(self) -> np.ndarray:
        ids = np.arange(self.vocab_size)
        return ids[~np.isin(ids, list(self.excluded_ids))] if self.excluded_ids else ids


@dataclass(frozen=True)
class PromptSpec:
    """One request to send: its prompt ids and how many tokens to generate."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    shared_prefix_tokens: int = 0


@dataclass(frozen=True)
class WorkloadSpec:
    """What to generate. Lengths left None take the workload's defaults (times ``scale``)."""

    name: WorkloadName
    num_prompts: int
    seed: int = 0
    scale: float = 1.0
    input_len: int | None = None  # random: prompt length; long-doc: document length
    output_len: int | None = None  # random and long-doc: tokens to generate
    shared_prefix_len: int | None = None  # long-doc: tokens every request shares
    max_model_len: int | None = None  # prompt + output are cut to fit, when known
    # long-doc: documents the requests ask about in turn (request i: document i mod this), so
    # request i >= num_documents is a repeat of an earlier document
    num_documents: int = 1

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"workload {self.name!r} is unknown; use one of {WORKLOADS}")
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if self.num_documents < 1:
            raise ValueError(f"--num-documents must be >= 1, got {self.num_documents}")
        if not self.scale > 0:
            raise ValueError(f"--scale must be > 0, got {self.scale}")
        for key in ("input_len", "output_len", "shared_prefix_len"):
            value = getattr(self, key)
            if value is not None and value < (0 if key == "shared_prefix_len" else 1):
                raise ValueError(f"--{key.replace('_', '-')} must be positive, got {value}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def long_doc_lengths(self) -> tuple[int, int, int]:
        """(document, shared prefix, output) tokens of the long-doc workload."""
        doc = self.input_len or _scaled(LONG_DOC_TOKENS, self.scale)
        shared = (self.shared_prefix_len if self.shared_prefix_len is not None
                  else _scaled(LONG_DOC_SHARED, self.scale))
        if shared >= doc:
            raise ValueError(f"the shared prefix ({shared} tokens) must be shorter than the "
                             f"document ({doc} tokens)")
        return doc, shared, self.output_len or _scaled(LONG_DOC_OUTPUT, self.scale)


def build_prompts(spec: WorkloadSpec, space: TokenSpace, round_index: int = 0) -> list[PromptSpec]:
    """The workload's requests. Same spec and round: same prompts. Each round draws fresh
    prompt content (so a later round at another rate finds no prefix of an earlier one
    cached), while the long document's shared prefix stays the same in every round. With
    several documents each round (warm-ups included) asks about documents of its own, so that
    each document's first request in a round finds nothing of it cached."""
    rng = np.random.default_rng([spec.seed, round_index])
    count = spec.num_prompts
    if spec.name == "long-doc":
        doc, shared_len, out = spec.long_doc_lengths()
        own = [round_index, 1] if spec.num_documents > 1 and round_index else []
        documents = [space.draw(np.random.default_rng([spec.seed, 1 << 30, *([k] if k else []),
                                                       *own]), shared_len)
                     for k in range(spec.num_documents)]
        pairs = [(documents[i % spec.num_documents] + space.draw(rng, doc - shared_len), out)
                 for i in range(count)]
        return _fit(spec, pairs, shared_len)
    if spec.name == "random":
        in_len = spec.input_len or _scaled(RANDOM_INPUT, spec.scale)
        out_len = spec.output_len or _scaled(RANDOM_OUTPUT, spec.scale)
        lengths: Iterable[tuple[int, int]] = [(in_len, out_len)] * count
    else:
        inputs, outputs = (CHAT_INPUT, CHAT_OUTPUT) if spec.name == "chat" else \
            (CODE_INPUT, CODE_OUTPUT)
        lengths = zip(inputs.draw(rng, count, spec.scale), outputs.draw(rng, count, spec.scale),
                      strict=True)
    return _fit(spec, [(space.draw(rng, n), out) for n, out in lengths], 0)


def _fit(spec: WorkloadSpec, pairs: list[tuple[list[int], int]],
         shared: int) -> list[PromptSpec]:
    """Cut prompts (from the end) so prompt + output fits the model's context."""
    prompts = []
    for ids, out in pairs:
        if spec.max_model_len is not None:
            out = min(out, spec.max_model_len - 1)
            ids = ids[: spec.max_model_len - out]
        prompts.append(PromptSpec(tuple(ids), out, min(shared, len(ids))))
    return prompts
