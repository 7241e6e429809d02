"""Turns one logits row per sampling request into a token: greedy, or temperature/top-k/top-p.

A random row inverts its distribution's CDF at its own uniform (`random_draws`: a function of
the request's seed and the output index), so a seed draws the same uniforms in any batch, on
either role. The logits it inverts can differ in the last float bits with the batch around the
row (padded decode groups, prefill chunks in the same step); a uniform within that of a
boundary between two tokens then takes the neighbouring token, and the texts part there
(`benchmarks/seed_stability.py`, tiny model on CPU, arrivals staggered: 3 of 1,800
twelve-token choices, each 1 to 3 token ids from the draw of the same choices started together).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.engine.attention.metadata import to_device
from pdserve.engine.logprobs import TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    # One entry per row (None for rows that asked for none); None if no row asked.
    logprobs: list[TokenLogprobs | None] | None


class TokenMask(Protocol):
    """The tokens some rows may not draw this step (their grammar's), masked in place."""

    def apply(self, logits: torch.Tensor) -> None: ...


def upload(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` (a list, or equal-length lists stacked as rows) as a tensor on ``device``,
    without waiting for the device (`to_device`)."""
    return to_device(torch.tensor(values, dtype=dtype), device)


class Sampler:
    """Stateless; one call per step over the rows that sample."""

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        uniforms: torch.Tensor,
        output_ids: Sequence[Sequence[int]] | None = None,
        mask: TokenMask | None = None,
    ) -> SamplerOutput:
        """``logits``: float [N, V]; ``params``: one per row; ``uniforms``: float32 [N] in
        [0, 1) on the logits' device, each row's draw (`random_draws`; greedy rows ignore
        theirs); ``output_ids``: each row's tokens generated so far (what penalties count;
        None: none yet); ``mask``: the grammar rows' disallowed tokens (None: no such row)."""
        if (logits.dim() != 2 or logits.shape[0] != len(params)
                or tuple(uniforms.shape) != (len(params),)):
            raise ValueError(
                f"sample: logits {tuple(logits.shape)} needs one row per params "
                f"({len(params)}) and uniform {tuple(uniforms.shape)}"
            )
        if mask is None and all(p.is_plain_greedy for p in params):
            return SamplerOutput(logits.argmax(dim=-1).tolist(), None)
        raw = logits = logits.float()
        adjusted = [i for i, p in enumerate(params) if p.adjusts_logits]
        if adjusted:
            logits = _penalize_and_bias(logits, params, output_ids, adjusted)
        if mask is not None:
            if logits is raw and any(p.logprobs is not None for p in params):
                logits = logits.clone()  # reported logprobs stay the raw distribution's
            mask.apply(logits)
        token_ids = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if random_rows:
            rows = upload(random_rows, torch.int64, logits.device)
            drawn = _draw(logits.index_select(0, rows), [params[i] for i in random_rows],
                          uniforms.index_select(0, rows))
            token_ids = token_ids.index_copy(0, rows, drawn)
        return _read_back(token_ids, raw, params)


def _draw(logits: torch.Tensor, params: list[SamplingParams],
          uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling, every row at once: the first token whose running probability
    exceeds the row's uniform (scaled by the row's total, which rounding keeps near 1).

    One random number per row, where a Gumbel race needs one per vocabulary entry. A token
    of probability 0 (top-k, top-p, a -100 bias) adds nothing to the running sum, so the
    search never lands on it; each token's share of [0, total) is its probability up to one
    float32 rounding of the sum."""
    vocab = logits.shape[1]
    # One upload for the rows' three settings; top-k as float32 is exact below 2**24.
    temperatures, top_k, top_p = upload(
        [[p.temperature for p in params], [p.top_k if p.top_k > 0 else vocab for p in params],
         [p.top_p for p in params]], torch.float32, logits.device)
    logits = logits / temperatures.unsqueeze(1)
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        logits = _apply_top_k_top_p(logits, top_k, top_p)
    cdf = torch.softmax(logits, dim=-1).cumsum_(dim=-1)
    total = cdf[:, -1:]
    # Strictly below the total, so the search stops inside the row even when u * total rounds
    # up to it.
    targets = torch.minimum(uniforms.unsqueeze(1) * total,
                            torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, targets, right=True).squeeze(1)


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
        lengths, index = upload([[len(output_ids[r]) for r in penalized], penalized],
                                torch.int64, device)
        flat = [t for r in penalized for t in output_ids[r]]
        generated = upload(flat, torch.int64, device)
        # The output's size given: a CUDA repeat_interleave would otherwise read it back.
        owner = torch.repeat_interleave(torch.arange(len(penalized), device=device), lengths,
                                        output_size=len(flat))
        counts = torch.zeros(len(penalized), vocab, dtype=logits.dtype, device=device)
        counts.index_put_((owner, generated), torch.ones_like(generated, dtype=logits.dtype),
                          accumulate=True)
        frequency, presence = upload(
            [[params[r].frequency_penalty for r in penalized],
             [params[r].presence_penalty for r in penalized]], logits.dtype, device).unsqueeze(2)
        penalty = frequency * counts + presence * (counts > 0)
        logits.index_copy_(0, index, logits.index_select(0, index) - penalty)
    biases = [(r, token, bias) for r in rows for token, bias in params[r].logit_bias]
    if biases:
        row_ids, token_ids, values = zip(*biases, strict=True)
        where = upload([list(row_ids), list(token_ids)], torch.int64, device)
        logits.index_put_((where[0], where[1]), upload(list(values), logits.dtype, device),
                          accumulate=True)
    return logits


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) every token outside each row's top-k (the vocabulary for none) and
    top-p nucleus."""
    vocab = logits.shape[1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    remove = ranks >= top_k.unsqueeze(1)
    sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    # Keep a token while the mass before it is below top_p: the most likely always stays.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # Rows with top_p == 1 skip this: float rounding can push the tail's mass past 1.
    remove |= (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    # A top_p below float32's smallest value (5e-324 is valid input) rounds to 0 and would
    # remove every token; the most likely one stays whatever the rounding.
    remove[:, 0] = False
    mask = torch.zeros_like(remove).scatter(1, sorted_ids, remove)
    return logits.masked_fill(mask, float("-inf"))


def _read_back(token_ids: torch.Tensor, logits: torch.Tensor,
               params: list[SamplingParams]) -> SamplerOutput:
    """The sampled tokens, and the logprobs of the rows that ask, in one copy to the host:
    one wait for the device a step. Float64 holds token ids and float32 values exactly."""
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not wanted:
        return SamplerOutput(token_ids.tolist(), None)
    rows = upload(wanted, torch.int64, logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, rows), dim=-1)
    sampled = logprobs.gather(1, token_ids.index_select(0, rows).unsqueeze(1)).squeeze(1)
    max_n = max(params[i].logprobs or 0 for i in wanted)
    parts = [token_ids.double(), sampled.double()]
    if max_n:
        top_values, top_ids = logprobs.topk(max_n, dim=-1)
        parts += [top_values.double().flatten(), top_ids.double().flatten()]
    host = torch.cat(parts).tolist()
    num_rows, num_wanted = len(params), len(wanted)
    tokens = [int(t) for t in host[:num_rows]]
    sampled_lp = host[num_rows:num_rows + num_wanted]
    top_values_l = host[num_rows + num_wanted:num_rows + num_wanted * (1 + max_n)]
    top_ids_l = host[num_rows + num_wanted * (1 + max_n):]
    result: list[TokenLogprobs | None] = [None] * num_rows
    for j, i in enumerate(wanted):
        first = j * max_n
        top = [(int(top_ids_l[first + m]), top_values_l[first + m])
               for m in range(params[i].logprobs or 0)]
        result[i] = TokenLogprobs(tokens[i], sampled_lp[j], top)
    return SamplerOutput(tokens, result)
