"""The engine thread's hand-over: a request's own stream loses and reorders nothing when its
reader lags, a step sink gets each step's outputs in one call, and a crash reaches both."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdserve.cluster.config import engine_config
from pdserve.engine.async_engine import AsyncEngine, merge_outputs
from pdserve.engine.engine import LLMEngine
from pdserve.engine.engine_outputs import RequestOutput
from pdserve.engine.errors import EngineDeadError
from pdserve.engine.logprobs import TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams

PROMPT = list(range(20, 60))
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_checkpoints: dict[str, str]) -> LLMEngine:
    return LLMEngine(engine_config(tiny_checkpoints["llama"], num_kv_blocks=64))


def run_stream(engine: LLMEngine, rid: str, consumer_delay_s: float) -> list[RequestOutput]:
    async def run() -> list[RequestOutput]:
        async_engine = AsyncEngine(engine)
        outs = []
        try:
            async for out in async_engine.generate(rid, PROMPT, PARAMS):
                outs.append(out)
                await asyncio.sleep(consumer_delay_s)
        finally:
            async_engine.shutdown()
        return outs

    return asyncio.run(run())


def test_a_stream_carries_every_token_and_the_same_text_however_fast_it_is_read(
        engine: LLMEngine) -> None:
    [want] = engine.generate([PROMPT], PARAMS)
    want_text = engine.tokenizer.decode(want)
    for rid, delay in (("each", 0.0), ("slow", 0.02)):
        outs = run_stream(engine, rid, delay)
        assert [t for out in outs for t in out.new_token_ids] == want, rid
        assert "".join(out.new_text for out in outs) == want_text, rid
        assert outs[-1].finished and not any(out.finished for out in outs[:-1])
        assert outs[-1].num_output_tokens == len(want)
        if rid == "slow":
            assert len(outs) < len(want)  # what arrived while the reader slept came merged


class RecordingSink:
    """A step sink that records each call's outputs (called on the engine thread)."""

    def __init__(self) -> None:
        self.steps: list[list[RequestOutput]] = []
        self.failure: BaseException | None = None
        self.finished = threading.Event()
        self.num_finished = 0

    def put_step(self, outputs: list[RequestOutput]) -> None:
        self.steps.append(list(outputs))
        self.num_finished += sum(out.finished for out in outputs)
        if self.num_finished == 3:
            self.finished.set()

    def fail_all(self, exc: BaseException) -> None:
        self.failure = exc


def test_a_step_sink_gets_every_request_of_a_step_in_one_call(engine: LLMEngine) -> None:
    prompts = [PROMPT, PROMPT[:20], PROMPT[5:]]
    want = engine.generate(prompts, PARAMS)
    sink = RecordingSink()
    async_engine = AsyncEngine(engine, step_sink=sink)
    try:
        for i, prompt in enumerate(prompts):
            async_engine.submit(lambda i=i, p=prompt: engine.add_request(f"s{i}", p, PARAMS))
        assert sink.finished.wait(60), "the three requests never finished"
    finally:
        async_engine.shutdown()
    got: dict[str, list[int]] = {f"s{i}": [] for i in range(3)}
    for step in sink.steps:
        assert len({out.request_id for out in step}) == len(step)  # one output per request
        for out in step:
            got[out.request_id].extend(out.new_token_ids)
    assert [got[f"s{i}"] for i in range(3)] == want
    # Decoding together, the three requests shared steps: far fewer calls than outputs.
    assert len(sink.steps) < sum(len(step) for step in sink.steps) / 2


def test_merge_joins_tokens_text_and_logprobs_in_order() -> None:
    def out(ids: list[int], text: str, finished: bool) -> RequestOutput:
        return RequestOutput("r", ids, text, finished, "length" if finished else None,
                             num_prompt_tokens=5, num_cached_tokens=0,
                             num_output_tokens=ids[-1],
                             logprobs=[TokenLogprobs(i, -0.5, []) for i in ids])
    merged = merge_outputs([out([1], "a", False), out([2, 3], "bc", False), out([4], "d", True)])
    assert merged.new_token_ids == [1, 2, 3, 4] and merged.new_text == "abcd"
    assert [lp.token_id for lp in merged.logprobs] == [1, 2, 3, 4]
    assert merged.finished and merged.finish_reason == "length" and merged.num_output_tokens == 4


def test_an_engine_crash_reaches_the_streams_and_the_sink(engine: LLMEngine) -> None:
    async def run() -> RecordingSink:
        sink = RecordingSink()
        async_engine = AsyncEngine(engine, step_sink=sink)
        stream = async_engine.open_stream("doomed")
        async_engine._fail_everything(RuntimeError("boom"))  # as the thread does on a crash
        try:
            with pytest.raises(EngineDeadError, match="boom"):
                async for _ in async_engine.stream("doomed", stream):
                    pass
        finally:
            async_engine.shutdown()
        return sink

    sink = asyncio.run(run())
    assert isinstance(sink.failure, EngineDeadError)
