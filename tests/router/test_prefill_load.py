"""When the ingress prefills a prompt on its decode worker instead of queueing it at the busy
prefill role: short prompts by the queue; long ones when decode's lending rate within its TPOT
bound beats the queue, one per decode replica at a time."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from pdserve.engine.prompt_allowance import PromptAllowance
from pdserve.router.pipeline import GenerationPipeline, PipelineSettings
from pdserve.router.prefill_load import LocalPrefillPolicy, PrefillLoad
from pdserve.router.roles import ReplicaLoad


def load() -> PrefillLoad:
    return PrefillLoad(LocalPrefillPolicy(max_local_tokens=512, queue_factor=2.0))


def test_a_prompt_goes_to_prefill_until_the_queue_there_is_twice_its_length() -> None:
    prefill = load()
    prefill.report(num_queued_tokens=1000, num_replicas=1)
    assert prefill.prefill_here(500) is None  # 1,000 queued is not more than 2 x 500
    assert prefill.prefill_here(400) == "prefill_busy"
    prefill.report(num_queued_tokens=1000, num_replicas=2)  # 500 per replica
    assert prefill.prefill_here(400) is None
    prefill.begin(2000)  # this ingress's own prompts show before any report
    assert prefill.prefill_here(400) == "prefill_busy"
    prefill.end(2000)
    assert prefill.prefill_here(400) is None


def test_a_long_prompt_goes_to_decode_when_lending_beats_the_prefill_queue() -> None:
    prefill = load()
    prefill.report(num_queued_tokens=7200, num_replicas=1)
    prefill.report_decode(2, lend_tokens_per_s=0, prompt_token_us=1000)
    assert prefill.prefill_here(3600) is None  # decode has nothing to lend
    # 1 ms a token: 10.8 s at prefill (7,200 queued + 3,600); decode lends 400 tokens/s: 9 s.
    prefill.report_decode(2, lend_tokens_per_s=400, prompt_token_us=1000)
    assert prefill.prefill_here(3600) == "prefill_busy_long"
    prefill.report(num_queued_tokens=3600, num_replicas=1)  # 7.2 s at prefill: stays there
    assert prefill.prefill_here(3600) is None
    prefill.report(num_queued_tokens=20_000, num_replicas=1)
    prefill.lend_begin()
    assert prefill.prefill_here(3600) == "prefill_busy_long"
    prefill.lend_begin()
    assert prefill.prefill_here(3600) is None  # both decode replicas have one
    assert prefill.prefill_here(300) == "prefill_busy"  # short ones are not counted


def test_without_the_decode_prompt_cap_long_prompts_always_go_to_prefill() -> None:
    # decode_prompt_tokens_per_step: 0 (colocated, or asked for): decode reports nothing to
    # lend, however its steps go.
    allowance = PromptAllowance(0, 0.04, 16)
    allowance.observe(0.001, num_decode_rows=4, num_prompt_tokens=0)
    allowance.observe(0.002, num_decode_rows=4, num_prompt_tokens=64)
    prefill = load()
    prefill.report(num_queued_tokens=1_000_000, num_replicas=1)
    prefill.report_decode(1, allowance.lend_tokens_per_s(), allowance.token_us())
    assert prefill.prefill_here(3600) is None
    assert prefill.prefill_here(512) == "prefill_busy"


class Roles:
    """The ingress's view of the roles, as `RoleMonitor` keeps it: counts and load reports."""

    def __init__(self, queued: int, num_decode: int) -> None:
        self.counts = {"prefill": 1, "decode": num_decode}
        self.queued = queued

    def missing(self) -> list[str]:
        return []

    def loads(self) -> list[ReplicaLoad]:
        return [ReplicaLoad(num_blocks=64, num_free_blocks=64, num_running=0, num_waiting=1,
                            num_queued_tokens=self.queued, role="prefill", replica_id="p0"),
                *(ReplicaLoad(num_blocks=64, num_free_blocks=64, num_running=4, num_waiting=0,
                              lend_tokens_per_s=400 * i, prompt_token_us=1000, role="decode",
                              replica_id=f"d{i}") for i in range(self.counts["decode"]))]


def test_the_pipeline_names_why_a_prompt_skips_the_prefill_role() -> None:
    settings = PipelineSettings("disaggregated", 16, LocalPrefillPolicy(512, 2.0))
    # Two decode replicas: one has nothing to lend, the other 400 tokens/s.
    pipeline = GenerationPipeline(None, object(), settings, None,  # type: ignore[arg-type]
                                  Roles(20_000, 2))  # type: ignore[arg-type]
    assert pipeline.choose_path(3600) == ("local_prefill", "prefill_busy_long")
    assert pipeline.choose_path(300) == ("local_prefill", "prefill_busy")
    for _ in range(2):  # each decode replica has one already
        pipeline.prefill_load.lend_begin()
    assert pipeline.choose_path(3600) == ("disaggregated", None)
    pipeline.roles = Roles(100, 2)  # type: ignore[assignment]
    assert pipeline.choose_path(300) == ("disaggregated", None)
    assert pipeline.choose_path(8) == ("local_prefill", None)  # too short to move its KV


class Trace:
    def update(self, **_: object) -> None:
        pass


def test_a_lent_prompt_holds_its_decode_replicas_turn_until_its_first_token() -> None:
    settings = PipelineSettings("disaggregated", 16, LocalPrefillPolicy(512, 2.0))
    pipeline = GenerationPipeline(None, object(), settings, None,  # type: ignore[arg-type]
                                  Roles(20_000, 2))  # type: ignore[arg-type]
    held: list[int] = []

    async def answers(*_: object) -> AsyncIterator[str]:
        held.append(pipeline.prefill_load.num_local_long)
        yield "first token"
        held.append(pipeline.prefill_load.num_local_long)
        yield "second"

    async def fails(*_: object) -> AsyncIterator[str]:
        held.append(pipeline.prefill_load.num_local_long)
        raise RuntimeError("decode replica lost")
        yield "never"

    async def run() -> list[str]:
        return [d async for d in pipeline.generate(  # type: ignore[arg-type]
            "r", [7] * 3600, None, Trace(), True)]

    pipeline._on_decode = answers  # type: ignore[method-assign]
    assert asyncio.run(run()) == ["first token", "second"]
    assert held == [1, 0]
    pipeline._on_decode = fails  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="decode replica lost"):
        asyncio.run(run())
    assert held[-1] == 1 and pipeline.prefill_load.num_local_long == 0
