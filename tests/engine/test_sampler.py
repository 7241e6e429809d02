"""Sampler tests: greedy, seeded reproducibility across batches, the drawn distribution against
the softmax (with temperature, top-k, top-p), logprobs, penalties.

Also the SamplingParams validation that guards the sampler's inputs.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.random_draws import DrawKey, draw_uniforms
from pdserve.engine.sampler import Sampler
from pdserve.engine.sampling_params import SamplingParams

VOCAB = 64


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _keys(*keys: tuple[int, int] | None) -> torch.Tensor:
    """Uniforms for rows keyed (seed, output index); None: a row that draws nothing."""
    return draw_uniforms([None if k is None else DrawKey(*k) for k in keys], "cpu")


def _none(rows: int) -> torch.Tensor:
    return torch.zeros(rows)


def _draws(row: torch.Tensor, params: SamplingParams, seed: int, steps: int = 8) -> list[int]:
    """One request's tokens over several steps (output indices 0..steps-1), sampled alone."""
    sampler = Sampler()
    return [sampler.sample(row[None], [params], _keys((seed, step))).token_ids[0]
            for step in range(steps)]


def test_greedy_is_argmax() -> None:
    logits = _logits(5)
    out = Sampler().sample(logits, [SamplingParams(temperature=0)] * 5, _none(5))
    assert out.token_ids == logits.argmax(dim=-1).tolist() and out.logprobs is None


def test_seed_reproduces_regardless_of_batch_position_and_neighbours() -> None:
    logits = _logits(4)
    params = SamplingParams(temperature=1.0, seed=1234)
    alone = _draws(logits[2], params, seed=1234)
    # Same request at row 0, then row 2, of batches of other (seeded, unseeded, greedy,
    # top-k) requests: other rows' keys and parameters change nothing of its draws.
    sampler = Sampler()
    neighbours = [SamplingParams(temperature=0.7), SamplingParams(seed=5, top_k=3),
                  SamplingParams(temperature=0)]
    first, second = [], []
    for step in range(8):
        batch = torch.stack([logits[2], logits[0], logits[1], logits[3]])
        keys = _keys((1234, step), (99, step + 3), (5, step), None)
        first.append(sampler.sample(batch, [params, *neighbours], keys).token_ids[0])
        batch = torch.stack([logits[0], logits[3], logits[2]])
        keys = _keys((7, 0), None, (1234, step))
        second.append(sampler.sample(batch, [neighbours[0], neighbours[2], params],
                                     keys).token_ids[2])
    assert first == second == alone
    assert len(set(alone)) > 1  # really sampling, not argmax


def test_a_draw_depends_on_its_output_index_not_on_earlier_draws() -> None:
    """What lets the prefill worker draw token 0 and the decode worker tokens 1.. of one seed:
    the draw at index i is the same whether or not indices 0..i-1 were drawn here."""
    row = _logits(1, seed=4)[0] / 3
    params = SamplingParams(temperature=1.0, seed=21)
    whole = _draws(row, params, seed=21, steps=12)
    resumed = [Sampler().sample(row[None], [params], _keys((21, i))).token_ids[0]
               for i in range(5, 12)]
    assert resumed == whole[5:]


def test_different_seeds_differ() -> None:
    row = torch.zeros(VOCAB)  # uniform: every seed draws its own sequence
    params = SamplingParams(temperature=1.0)
    assert _draws(row, params, seed=1) != _draws(row, params, seed=2)


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1] + [0.0] * (VOCAB - 3))
    row = torch.log(probs.clamp(min=1e-30))
    tokens = _draws(row, SamplingParams(temperature=1.0), seed=0, steps=2000)
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).float() / len(tokens)
    assert torch.allclose(counts[:3], probs[:3], atol=0.04)
    assert counts[3:].sum() == 0


def _reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """What a draw should follow, computed the plain way in float64: softmax at the
    temperature, keep the top_k most likely, then the smallest prefix of them (by
    probability) whose mass reaches top_p, renormalized."""
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    order = probs.argsort(descending=True).tolist()
    kept = order[:params.top_k] if params.top_k > 0 else order
    renormed = probs[kept] / probs[kept].sum()
    mass, nucleus = 0.0, []
    for token, p in zip(kept, renormed.tolist(), strict=True):
        nucleus.append(token)
        mass += p
        if mass >= params.top_p:
            break
    out = torch.zeros_like(probs)
    out[nucleus] = probs[nucleus] / probs[nucleus].sum()
    return out


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.3, top_k=12),
    SamplingParams(temperature=0.9, top_p=0.8),
    SamplingParams(temperature=1.1, top_k=20, top_p=0.9),
], ids=["plain", "cool", "top_k", "top_p", "top_k_top_p"])
def test_empirical_distribution_matches_the_softmax(params: SamplingParams) -> None:
    """40,000 seeded draws of one row (one batch of 40,000 keyed rows): every token's
    frequency lies within 5 standard errors of its probability, and no token outside top-k
    and the nucleus is ever drawn."""
    n = 40_000
    row = _logits(1, seed=8)[0] / 2  # a spread of probabilities from ~0.2 down to ~1e-4
    want = _reference_probs(row, params)
    keys = draw_uniforms([DrawKey(2024, i) for i in range(n)], "cpu")
    tokens = Sampler().sample(row.expand(n, VOCAB), [params] * n, keys).token_ids
    got = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double() / n
    bound = 5 * (want * (1 - want) / n).sqrt() + 1 / n
    assert ((got - want).abs() <= bound).all(), (got - want).abs().max()
    assert (got[want == 0] == 0).all()
    assert int((want > 0).sum()) > 3  # the data leaves a real choice


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.5, top_k=1, seed=3),
        SamplingParams(temperature=1.5, top_p=1e-6, seed=3),
        SamplingParams(temperature=1.5, top_k=5, top_p=1e-6, seed=3),
        # the smallest positive double: 0 in float32, where the nucleus is computed
        SamplingParams(temperature=1.5, top_p=5e-324, seed=3),
    ],
)
def test_top_k_one_and_tiny_top_p_equal_greedy(params: SamplingParams) -> None:
    logits = _logits(6, seed=1)
    out = Sampler().sample(logits, [params] * 6, _keys(*[(i, 0) for i in range(6)]))
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_and_top_p_only_draw_inside_their_sets() -> None:
    row = _logits(1, seed=2)[0] / 3  # flat enough for a nucleus of several tokens
    top5 = set(row.topk(5).indices.tolist())
    assert set(_draws(row, SamplingParams(top_k=5, temperature=2.0), seed=0, steps=200)) <= top5
    probs = torch.softmax(row, dim=-1)
    order = probs.argsort(descending=True)
    nucleus_size = int((probs[order].cumsum(0) < 0.5).sum()) + 1
    nucleus = set(order[:nucleus_size].tolist())
    drawn = set(_draws(row, SamplingParams(top_p=0.5), seed=0, steps=200))
    assert nucleus_size > 1  # else this data would not test the cut
    assert drawn <= nucleus and len(drawn) > 1


def test_logprobs_of_sampled_token_and_top_alternatives() -> None:
    logits = _logits(3)
    params = [
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logprobs=0),
    ]
    out = Sampler().sample(logits, params, _none(3))
    assert out.logprobs is not None and out.logprobs[1] is None
    expected = torch.log_softmax(logits, dim=-1)
    first = out.logprobs[0]
    assert first is not None and first.token_id == out.token_ids[0]
    assert math.isclose(first.logprob, expected[0].max().item(), rel_tol=1e-5)
    assert [t for t, _ in first.top] == expected[0].topk(3).indices.tolist()
    assert [lp for _, lp in first.top] == sorted((lp for _, lp in first.top), reverse=True)
    # The float32 values exactly, and ids as ints, after their trip to the host.
    assert [lp for _, lp in first.top] == expected[0].topk(3).values.tolist()
    assert all(type(t) is int for t, _ in first.top) and type(out.token_ids[0]) is int
    third = out.logprobs[2]
    assert third is not None and third.top == []


def test_penalties_count_generated_tokens_and_bias_adds_to_logits() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, :4] = torch.tensor([5.0, 4.5, 4.0, 1.0])
    generated = [[0, 0, 1]]  # token 0 twice, token 1 once

    def greedy(**kwargs: Any) -> int:
        params = SamplingParams(temperature=0, **kwargs)
        return Sampler().sample(logits, [params], _none(1), generated).token_ids[0]

    assert greedy() == 0
    assert greedy(presence_penalty=0.6) == 0  # 4.4 / 3.9 / 4.0: presence alone keeps 0
    assert greedy(frequency_penalty=0.4) == 0  # 4.2 / 4.1 / 4.0
    assert greedy(frequency_penalty=0.6) == 2  # 3.8 / 3.9 / 4.0: per occurrence
    assert greedy(presence_penalty=1.0, frequency_penalty=0.1) == 2  # 3.8 / 3.4 / 4.0
    assert greedy(frequency_penalty=-1.0) == 0  # negative: repeat more
    assert greedy(logit_bias={3: 10.0}) == 3
    assert greedy(logit_bias={0: -100.0, 1: -100.0}) == 2
    # Nothing generated yet: penalties change nothing; the raw logprobs are reported either way.
    out = Sampler().sample(logits, [SamplingParams(temperature=0, frequency_penalty=2.0,
                                                   logprobs=1)], _none(1), [[]])
    assert out.token_ids == [0] and out.logprobs is not None and out.logprobs[0] is not None
    assert math.isclose(out.logprobs[0].logprob, torch.log_softmax(logits[0], -1)[0].item(),
                        rel_tol=1e-6)


def test_penalties_and_biases_of_a_whole_batch_match_row_by_row_arithmetic() -> None:
    logits = _logits(5, seed=3)
    top = logits.argmax(dim=-1).tolist()  # penalize each row's favourite, so choices move
    generated = [[top[0], top[0], 2], [], [top[2], 5, 5, 7], [top[3]], [top[4], 4]]
    params = [SamplingParams(temperature=0, frequency_penalty=1.5),
              SamplingParams(temperature=0, logit_bias={3: 10.0}),
              SamplingParams(temperature=0, presence_penalty=-2.0, frequency_penalty=0.5,
                             logit_bias={7: -1.0, 8: 2.5}),
              SamplingParams(temperature=0),
              SamplingParams(temperature=0, presence_penalty=2.0, logit_bias={4: 1.0})]
    expected = logits.clone()
    for row, (p, ids) in enumerate(zip(params, generated, strict=True)):
        for token in set(ids):
            expected[row, token] -= p.frequency_penalty * ids.count(token) + p.presence_penalty
        for token, bias in p.logit_bias:
            expected[row, token] += bias
    out = Sampler().sample(logits, params, _none(5), generated)
    assert out.token_ids == expected.argmax(dim=-1).tolist()
    assert out.token_ids != logits.argmax(dim=-1).tolist()  # the data does move some rows


def test_a_banned_token_is_never_drawn_and_neighbours_are_untouched() -> None:
    logits = _logits(2)
    favourite = int(logits[0].argmax())
    banned = SamplingParams(temperature=1.5, seed=3, logit_bias={favourite: -100.0})
    plain = SamplingParams(temperature=0)
    for step in range(40):
        out = Sampler().sample(logits, [banned, plain], _keys((3, step), None))
        assert out.token_ids[0] != favourite
        assert out.token_ids[1] == int(logits[1].argmax())


def test_mismatched_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="one row per params"):
        Sampler().sample(_logits(2), [SamplingParams()], _none(1))
    with pytest.raises(ValueError, match="one row per params"):
        Sampler().sample(_logits(2), [SamplingParams()] * 2, _none(3))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"seed": 2**64}, "seed"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": ("",)}, "stop"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"max_tokens": True}, "max_tokens"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("inf")}, "frequency_penalty"),
        ({"logit_bias": {3: 100.5}}, "logit_bias"),
        ({"logit_bias": {-3: 1.0}}, "logit_bias"),
        ({"logit_bias": ((3, 1.0), (3, 2.0))}, "logit_bias"),
    ],
)
def test_invalid_params_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**kwargs)


def test_params_normalize_edge_inputs() -> None:
    params = SamplingParams(stop="###", stop_token_ids=[5, 6], temperature=0)  # type: ignore[arg-type]
    assert params.stop == ("###",) and params.stop_token_ids == (5, 6) and params.is_greedy
    assert hash(params) == hash(SamplingParams(stop=("###",), stop_token_ids=(5, 6), temperature=0))
    assert SamplingParams(seed=-1).seed == -1  # negative seeds are accepted


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_seeded_sampling_on_cuda_matches_the_cpu_and_itself_across_batches() -> None:
    """The uniforms are the same numbers on both devices; a row's draw on CUDA is the one the
    CPU makes, alone or in a batch."""
    logits = _logits(3)
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=7),
              SamplingParams(temperature=0)]
    keys = [DrawKey(11, 4), DrawKey(7, 0), None]
    sampler = Sampler()
    assert torch.equal(draw_uniforms(keys, "cuda").cpu(), draw_uniforms(keys, "cpu"))
    on_cpu = sampler.sample(logits, params, draw_uniforms(keys, "cpu")).token_ids
    batch = sampler.sample(logits.cuda(), params, draw_uniforms(keys, "cuda")).token_ids
    alone = sampler.sample(logits[1:2].cuda(), params[1:2], draw_uniforms(keys[1:2], "cuda"))
    assert batch == on_cpu and batch[1] == alone.token_ids[0]
    assert batch[2] == logits[2].argmax().item()
