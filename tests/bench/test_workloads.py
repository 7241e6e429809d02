"""Synthetic workloads: token-exact lengths, a long document's shared prefix, seeded repeats,
ShareGPT-like mean lengths, no special tokens, prompts cut to the model's context."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.bench.workloads import TokenSpace, WorkloadSpec, build_prompts
from pdserve.engine.tokenizer import Tokenizer

SPACE = TokenSpace(1024, frozenset({0, 1, 2}))


def test_long_doc_shares_its_prefix_and_scales() -> None:
    spec = WorkloadSpec("long-doc", num_prompts=6, seed=1, scale=0.25)
    assert spec.long_doc_lengths() == (2048, 1536, 64)
    prompts = build_prompts(spec, SPACE)
    assert all(len(p.prompt_ids) == 2048 and p.max_tokens == 64 for p in prompts)
    assert all(p.shared_prefix_tokens == 1536 for p in prompts)
    prefixes = {p.prompt_ids[:1536] for p in prompts}
    suffixes = {p.prompt_ids[1536:] for p in prompts}
    assert len(prefixes) == 1 and len(suffixes) == 6
    # Another round: fresh questions, the same document.
    again = build_prompts(spec, SPACE, round_index=1)
    assert again[0].prompt_ids[:1536] == prompts[0].prompt_ids[:1536]
    assert {p.prompt_ids[1536:] for p in again}.isdisjoint(suffixes)


def test_same_seed_same_prompts_other_seed_others() -> None:
    spec = WorkloadSpec("chat", num_prompts=20, seed=5)
    assert build_prompts(spec, SPACE) == build_prompts(spec, SPACE)
    other = build_prompts(WorkloadSpec("chat", num_prompts=20, seed=6), SPACE)
    assert other != build_prompts(spec, SPACE)


@pytest.mark.parametrize(("name", "mean_in", "mean_out"), [("chat", 750, 200), ("code", 180, 48)])
def test_lengths_average_what_the_workload_says(name: str, mean_in: float,
                                                mean_out: float) -> None:
    prompts = build_prompts(WorkloadSpec(name, num_prompts=4000, seed=0), SPACE)
    ins = np.array([len(p.prompt_ids) for p in prompts])
    outs = np.array([p.max_tokens for p in prompts])
    # Clipping the long tail takes a little off the log-normal's mean.
    assert ins.mean() == pytest.approx(mean_in, rel=0.08)
    assert outs.mean() == pytest.approx(mean_out, rel=0.08)
    assert ins.std() > 0.3 * ins.mean()  # long-tailed, not constant


def test_random_is_exact_and_never_draws_special_tokens() -> None:
    prompts = build_prompts(WorkloadSpec("random", 50, input_len=100, output_len=7), SPACE)
    assert {len(p.prompt_ids) for p in prompts} == {100} and {p.max_tokens for p in prompts} == {7}
    drawn = {t for p in prompts for t in p.prompt_ids}
    assert drawn.isdisjoint({0, 1, 2}) and max(drawn) < 1024


def test_prompts_are_cut_to_the_context() -> None:
    spec = WorkloadSpec("random", 3, input_len=4000, output_len=200, max_model_len=1024)
    assert {(len(p.prompt_ids), p.max_tokens) for p in build_prompts(spec, SPACE)} == {(824, 200)}


def test_token_space_of_a_real_tokenizer_leaves_out_its_special_tokens(
        tiny_checkpoints: dict[str, str]) -> None:
    tokenizer = Tokenizer.from_checkpoint(tiny_checkpoints["llama"])
    space = TokenSpace.of(tokenizer)
    assert space.vocab_size == tokenizer.vocab_size
    assert set(tokenizer.eos_token_ids) <= space.excluded_ids
    ids = space.draw(np.random.default_rng(0), 5000)
    assert space.excluded_ids.isdisjoint(ids)


@pytest.mark.parametrize("kwargs", [{"num_prompts": 0}, {"scale": 0.0},
                                    {"input_len": 0}, {"name": "sonnet"}])
def test_bad_specs_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="must|unknown"):
        WorkloadSpec(**{"name": "random", "num_prompts": 2, **kwargs})


def test_a_prefix_as_long_as_the_document_is_refused() -> None:
    with pytest.raises(ValueError, match="shorter than the document"):
        WorkloadSpec("long-doc", 2, input_len=100, shared_prefix_len=100).long_doc_lengths()
