"""Constrained decoding in the engine: compile cache, masks on grammar rows only, catch-up.

The tiny checkpoint's weights are random: without a grammar its output is never JSON.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from pdserve.cluster.config import engine_config
from pdserve.engine.engine import LLMEngine
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.grammar import check_grammar
from pdserve.engine.grammar_spec import GrammarSpec
from pdserve.engine.sampler import Sampler
from pdserve.engine.sampling_params import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tiny_checkpoints: dict[str, str]) -> LLMEngine:
    return LLMEngine(engine_config(tiny_checkpoints["llama"], num_kv_blocks=128))


def _prompt(engine: LLMEngine) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": "a person, as JSON"}])


def _all_blocks_free(engine: LLMEngine) -> None:
    """Every block back (cached ones count as free), nothing left queued; integrity checked."""
    stats = engine.kv_stats()
    assert stats.num_free_blocks == stats.num_blocks
    assert (stats.num_running, stats.num_waiting) == (0, 0)


def test_schema_outputs_validate_and_free_rows_do_not(engine: LLMEngine) -> None:
    spec = GrammarSpec.json_schema(SCHEMA)
    params = [SamplingParams(max_tokens=120, seed=i, grammar=spec if i % 2 == 0 else None)
              for i in range(8)]
    outputs = engine.generate([_prompt(engine)] * 8, params)
    for i, output in enumerate(outputs):
        text = engine.tokenizer.decode(output)
        if i % 2 == 0:
            assert output[-1] in engine.tokenizer.eos_token_ids, text
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            with pytest.raises(json.JSONDecodeError):
                json.loads(text)
    _all_blocks_free(engine)


def test_a_repeat_compiles_nothing(engine: LLMEngine) -> None:
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"x": {"type": "boolean"}}})
    engine.grammars.get(spec)
    compiled = engine.grammars.stats.num_compiled
    engine.grammars.get(GrammarSpec.json_schema(  # the same schema, another request's copy
        json.loads('{"type": "object", "properties": {"x": {"type": "boolean"}}}')))
    assert engine.grammars.stats.num_compiled == compiled


def test_resumed_tokens_advance_the_matcher(engine: LLMEngine) -> None:
    """A recompute resumes from tokens the client has: the rest continues the same JSON."""
    spec = GrammarSpec.json_schema(SCHEMA)
    prompt = _prompt(engine)
    [whole] = engine.generate([prompt], SamplingParams(max_tokens=120, seed=3, grammar=spec))
    head = whole[:4]
    engine.add_request("resumed", prompt, SamplingParams(max_tokens=120, seed=9, grammar=spec),
                       resume_output_ids=head)
    tokens = list(head)
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
    jsonschema.validate(json.loads(engine.tokenizer.decode(tokens)), SCHEMA)
    _all_blocks_free(engine)


def test_greedy_grammar_row_takes_the_best_allowed_token() -> None:
    class OnlyToken:
        def apply(self, logits: torch.Tensor) -> None:
            logits[0, :5] = float("-inf")

    logits = torch.arange(6, dtype=torch.float32).repeat(2, 1)
    out = Sampler().sample(logits.clone(), [SamplingParams(temperature=0.0)] * 2,
                           torch.zeros(2), mask=None)
    assert out.token_ids == [5, 5]
    logits[:, 5] = -1.0  # the mask's row must pick among what it leaves: token 5 only
    out = Sampler().sample(logits.clone(), [SamplingParams(temperature=0.0)] * 2,
                           torch.zeros(2), mask=OnlyToken())
    assert out.token_ids == [5, 4]


@pytest.mark.parametrize("schema, why", [
    ({"type": "object", "properties": {"x": {"type": "nonsense"}}}, "nonsense"),
    ({"type": "string", "pattern": "(unclosed"}, ""),
])
def test_a_schema_that_cannot_compile_is_refused(schema: dict[str, object], why: str) -> None:
    with pytest.raises(InvalidRequestError, match="cannot be used") as info:
        check_grammar(GrammarSpec.json_schema(schema))
    assert why in str(info.value) and ".cc:" not in str(info.value)


def test_preempted_requests_keep_their_grammar(tiny_checkpoints: dict[str, str]) -> None:
    """Too few blocks for all at once: requests are preempted and recomputed mid-answer; each
    matcher keeps its place (the output tokens survive preemption) and every answer is valid."""
    engine = LLMEngine(engine_config(tiny_checkpoints["llama"], num_kv_blocks=10,
                                     block_size=16))
    spec = GrammarSpec.json_schema(SCHEMA)
    params = [SamplingParams(max_tokens=120, seed=i, grammar=spec) for i in range(6)]
    outputs = engine.generate([_prompt(engine)] * 6, params)
    assert engine.stats.num_preemptions > 0
    for output in outputs:
        jsonschema.validate(json.loads(engine.tokenizer.decode(output)), SCHEMA)
    _all_blocks_free(engine)


def test_free_batches_start_no_mask(engine: LLMEngine) -> None:
    from pdserve.engine.request import Request

    masks = engine.runner.grammars
    assert masks is not None
    free = [Request(f"free{i}", [5, 6], SamplingParams(), (2,)) for i in range(4)]
    assert masks.start(free) is None
    mixed = free + [Request("json", [5, 6], SamplingParams(grammar=GrammarSpec.json_object()),
                            (2,))]
    pending = masks.start(mixed)
    assert pending is not None
    mask = pending.result()
    assert mask is not None and mask.rows == [4]


def test_json_never_gets_raw_control_characters_or_surrogates() -> None:
    from pdserve.engine.grammar import SurrogateGuard, grammar_vocabulary

    pieces = [b'"', b"a", b"\x13", b"x\ty", b"\n", b"\xed", b"\xb2\x99", b"\xed\xb2\x99",
              b"\xe5\xb1\xb1", b"<|im_end|>"]
    vocabulary = grammar_vocabulary(12, len(pieces), pieces.__getitem__, frozenset({9}))
    assert vocabulary == [b'"', b"a", b"", b"", b"\n", b"\xed", b"\xb2\x99", b"", b"\xe5\xb1\xb1",
                          b"", b"", b""]
    guard = SurrogateGuard.of(vocabulary)
    assert guard.ends_on_lead == {5}
    allowed = [bool(int(guard.after_lead[0]) >> i & 1) for i in range(12)]
    assert allowed == [True] * 6 + [False] + [True] * 5  # not A0..BF after ED


def test_masks_filled_during_the_forward_pass_are_the_same(engine: LLMEngine) -> None:
    """On CUDA the masks' thread fills them while the model runs: same tokens either way."""
    masks = engine.runner.grammars
    assert masks is not None
    spec = GrammarSpec.json_schema(SCHEMA)
    params = [SamplingParams(max_tokens=120, seed=i, grammar=spec if i % 2 else None)
              for i in range(6)]
    outputs = {}
    for overlap in (False, True):
        masks.overlap = overlap
        try:
            outputs[overlap] = engine.generate([_prompt(engine)] * 6, params)
        finally:
            masks.overlap = False
    assert outputs[True] == outputs[False]
    for output in outputs[True][1::2]:
        jsonschema.validate(json.loads(engine.tokenizer.decode(output)), SCHEMA)
    _all_blocks_free(engine)


def test_past_the_grammars_end_only_stop_tokens_follow(engine: LLMEngine) -> None:
    """With ignore_eos a constrained answer runs past its JSON: every later token is a stop
    token, so the text is still the one valid value."""
    spec = GrammarSpec.json_schema({"type": "boolean"})
    [output] = engine.generate([_prompt(engine)], SamplingParams(
        max_tokens=24, seed=5, grammar=spec, ignore_eos=True))
    stops = set(engine.tokenizer.eos_token_ids)
    first_stop = next(i for i, t in enumerate(output) if t in stops)
    assert len(output) == 24 and all(t in stops for t in output[first_stop:])
    assert json.loads(engine.tokenizer.decode(output[:first_stop])) in (True, False)
