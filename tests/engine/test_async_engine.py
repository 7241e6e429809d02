"""The engine thread's output streams: batching by interval loses and reorders nothing, the
first output and the finished one are never held back, and errors still arrive."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.cluster.config import engine_config
from pdserve.engine.async_engine import AsyncEngine, EngineDeadError, merge_outputs
from pdserve.engine.engine import LLMEngine, RequestOutput
from pdserve.engine.sampler import TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams

PROMPT = list(range(20, 60))
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_checkpoints: dict[str, str]) -> LLMEngine:
    return LLMEngine(engine_config(tiny_checkpoints["llama"], num_kv_blocks=64))


def run_stream(engine: LLMEngine, rid: str, interval_s: float | None,
               consumer_delay_s: float = 0.0, params: SamplingParams = PARAMS,
               ) -> list[tuple[float, RequestOutput]]:
    async def run() -> list[tuple[float, RequestOutput]]:
        async_engine = AsyncEngine(engine)
        outs = []
        try:
            async for out in async_engine.generate(rid, PROMPT, params, interval_s=interval_s):
                outs.append((time.monotonic(), out))
                await asyncio.sleep(consumer_delay_s)
        finally:
            async_engine.shutdown()
        return outs

    return asyncio.run(run())


def test_batched_streams_carry_every_token_and_the_same_text(engine: LLMEngine) -> None:
    [want] = engine.generate([PROMPT], PARAMS)
    want_text = engine.tokenizer.decode(want)
    for rid, interval, delay in (("each", 0.0, 0.0), ("slow", 0.0, 0.02), ("timed", 0.03, 0.0)):
        outs = [out for _, out in run_stream(engine, rid, interval, delay)]
        assert [t for out in outs for t in out.new_token_ids] == want, rid
        assert "".join(out.new_text for out in outs) == want_text, rid
        assert outs[-1].finished and not any(out.finished for out in outs[:-1])
        assert outs[-1].num_output_tokens == len(want)
        if rid == "each":
            assert len(outs) == len(want)  # the tiny model steps faster than this reads
        else:
            assert len(outs) < len(want)  # batched: fewer messages than tokens


def test_the_first_output_is_never_batched(engine: LLMEngine) -> None:
    outs = run_stream(engine, "first", interval_s=5.0)
    assert len(outs[0][1].new_token_ids) == 1


def test_none_sends_the_first_output_and_then_only_the_finished_one(engine: LLMEngine) -> None:
    outs = [out for _, out in run_stream(engine, "whole", interval_s=None)]
    assert [len(out.new_token_ids) for out in outs] == [1, PARAMS.max_tokens - 1]
    assert outs[-1].finished


def test_a_finished_output_is_not_held_for_the_interval(engine: LLMEngine) -> None:
    short = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    start = time.monotonic()
    outs = run_stream(engine, "short", interval_s=30.0, params=short)
    assert outs[-1][1].finished and outs[-1][0] - start < 10.0


def test_merge_joins_tokens_text_and_logprobs_in_order() -> None:
    def out(ids: list[int], text: str, finished: bool) -> RequestOutput:
        return RequestOutput("r", ids, text, finished, "length" if finished else None,
                             num_prompt_tokens=5, num_cached_tokens=0,
                             num_output_tokens=ids[-1],
                             logprobs=[TokenLogprobs(i, -0.5, ()) for i in ids])
    merged = merge_outputs([out([1], "a", False), out([2, 3], "bc", False), out([4], "d", True)])
    assert merged.new_token_ids == [1, 2, 3, 4] and merged.new_text == "abcd"
    assert [lp.token_id for lp in merged.logprobs] == [1, 2, 3, 4]
    assert merged.finished and merged.finish_reason == "length" and merged.num_output_tokens == 4


def test_an_engine_crash_reaches_the_stream(engine: LLMEngine) -> None:
    async def run() -> None:
        async_engine = AsyncEngine(engine)
        stream = async_engine.open_stream("doomed")
        async_engine._fail_everything(RuntimeError("boom"))  # as the thread does on a crash
        try:
            with pytest.raises(EngineDeadError, match="boom"):
                async for _ in async_engine.stream("doomed", stream, 0.05):
                    pass
        finally:
            async_engine.shutdown()

    asyncio.run(run())
