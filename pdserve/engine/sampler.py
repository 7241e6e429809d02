"""Turns one logits row per sampling request into a token: greedy, or temperature/top-k/top-p.

Seeded rows draw only from their own generator, so a seed reproduces in any batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities for one sampled token, from the model's raw distribution
    (before temperature, top-k and top-p), as OpenAI's ``logprobs`` reports them."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the `logprobs` most likely (token_id, logprob), best first


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    # One entry per row (None for rows that asked for none); None if no row asked.
    logprobs: list[TokenLogprobs | None] | None


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator for a seeded request (None: draw from the global RNG)."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(draw_seed(seed, 0))
    return generator


_MASK64 = 2**64 - 1


def _mix64(x: int) -> int:
    # splitmix64's finalizer: every input bit flips about half of the output bits.
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_seed(seed: int, index: int) -> int:
    """The generator seed of a request's ``index``-th draw: a hash of all 64 bits of ``seed``
    (taken mod 2**64, so negative seeds are valid) and of ``index``. torch's CPU generator
    (mt19937) keeps only the low 32 bits of what it is seeded with, so seeds that differ
    only above bit 31 must differ there too."""
    return _mix64((_mix64(seed & _MASK64) + index) & _MASK64)


class Sampler:
    """Stateless; one call per step over the rows that sample."""

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        output_ids: Sequence[Sequence[int]] | None = None,
    ) -> SamplerOutput:
        """``logits``: float [N, V]; ``params``/``generators``: one per row; ``output_ids``:
        each row's tokens generated so far (what penalties count; None: none yet)."""
        if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
            raise ValueError(
                f"sample: logits {tuple(logits.shape)} needs one row per params "
                f"({len(params)}) and generator ({len(generators)})"
            )
        if all(p.is_plain_greedy for p in params):
            return SamplerOutput(logits.argmax(dim=-1).tolist(), None)
        raw = logits = logits.float()
        adjusted = [i for i, p in enumerate(params) if p.adjusts_logits]
        if adjusted:
            logits = _penalize_and_bias(logits, params, output_ids, adjusted)
        token_ids = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            drawn = self._draw(
                logits.index_select(0, rows),
                [params[i] for i in random_rows],
                [generators[i] for i in random_rows],
            )
            token_ids = token_ids.index_copy(0, rows, drawn)
        token_list = token_ids.tolist()
        return SamplerOutput(token_list, _logprobs(raw, params, token_list))

    def _draw(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:
        temperatures = torch.tensor([p.temperature for p in params], device=logits.device)
        logits = logits / temperatures.unsqueeze(1)
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            logits = _apply_top_k_top_p(logits, params)
        probs = torch.softmax(logits, dim=-1)
        # Exponential race (Gumbel-max): argmax(p / E) with E ~ Exp(1) draws from p. Each
        # seeded row fills its own noise from its own generator, independent of the batch.
        noise = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            noise[unseeded] = torch.empty(
                len(unseeded), probs.shape[1], device=probs.device
            ).exponential_()
        for i, generator in enumerate(generators):
            if generator is not None:
                noise[i].exponential_(generator=generator)
        # A zero draw would make 0/0 = NaN for a masked token, and argmax prefers NaN.
        return (probs / noise.clamp_(min=1e-20)).argmax(dim=-1)


def _penalize_and_bias(logits: torch.Tensor, params: list[SamplingParams],
                       output_ids: Sequence[Sequence[int]] | None,
                       rows: list[int]) -> torch.Tensor:
    """A copy of ``logits`` with each of ``rows`` lowered by its penalties for the tokens it
    generated so far (presence once, frequency per occurrence) and raised by its bias: one
    scatter for all rows' counts, one for all biases, whatever the batch."""
    logits = logits.clone()
    device, vocab = logits.device, logits.shape[1]
    penalized = [r for r in rows if output_ids is not None and len(output_ids[r])
                 and (params[r].presence_penalty or params[r].frequency_penalty)]
    if penalized:
        assert output_ids is not None
        lengths = torch.tensor([len(output_ids[r]) for r in penalized], device=device)
        generated = torch.tensor([t for r in penalized for t in output_ids[r]], device=device)
        owner = torch.repeat_interleave(torch.arange(len(penalized), device=device), lengths)
        counts = torch.zeros(len(penalized), vocab, dtype=logits.dtype, device=device)
        counts.index_put_((owner, generated), torch.ones_like(generated, dtype=logits.dtype),
                          accumulate=True)
        frequency, presence = (torch.tensor([getattr(params[r], name) for r in penalized],
                                            dtype=logits.dtype, device=device).unsqueeze(1)
                               for name in ("frequency_penalty", "presence_penalty"))
        index = torch.tensor(penalized, device=device)
        penalty = frequency * counts + presence * (counts > 0)
        logits.index_copy_(0, index, logits.index_select(0, index) - penalty)
    biases = [(r, token, bias) for r in rows for token, bias in params[r].logit_bias]
    if biases:
        row_ids, token_ids, values = zip(*biases, strict=True)
        logits.index_put_((torch.tensor(row_ids, device=device),
                           torch.tensor(token_ids, device=device)),
                          torch.tensor(values, dtype=logits.dtype, device=device),
                          accumulate=True)
    return logits


def _apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask (to -inf) every token outside each row's top-k and top-p nucleus."""
    vocab = logits.shape[1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=logits.device)
    remove = ranks >= top_k.unsqueeze(1)
    top_p = torch.tensor([p.top_p for p in params], device=logits.device)
    sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    # Keep a token while the mass before it is below top_p: the most likely always stays.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # Rows with top_p == 1 skip this: float rounding can push the tail's mass past 1.
    remove |= (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    mask = torch.zeros_like(remove).scatter(1, sorted_ids, remove)
    return logits.masked_fill(mask, float("-inf"))


def _logprobs(
    logits: torch.Tensor, params: list[SamplingParams], token_ids: list[int]
) -> list[TokenLogprobs | None] | None:
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not wanted:
        return None
    rows = torch.tensor(wanted, device=logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, rows), dim=-1)
    max_n = max(params[i].logprobs or 0 for i in wanted)
    top_values, top_ids = logprobs.topk(max_n, dim=-1) if max_n else (None, None)
    sampled = torch.tensor([token_ids[i] for i in wanted], device=logits.device)
    sampled_lp = logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1).tolist()
    top_values_l = top_values.tolist() if top_values is not None else None
    top_ids_l = top_ids.tolist() if top_ids is not None else None
    result: list[TokenLogprobs | None] = [None] * len(params)
    for j, i in enumerate(wanted):
        n = params[i].logprobs or 0
        top = (
            list(zip(top_ids_l[j][:n], top_values_l[j][:n], strict=True))
            if top_ids_l is not None and top_values_l is not None
            else []
        )
        result[i] = TokenLogprobs(token_ids[i], sampled_lp[j], top)
    return result
