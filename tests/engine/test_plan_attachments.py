"""Step plan attachments: plain data rank 0's worker adds per request, carried in the msgpack
plan to every other rank's layer hook in the step it was attached to; anything else refused."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import pytest

from pdserve.cluster.config import engine_config
from pdserve.engine.engine import LLMEngine
from pdserve.engine.parallel.group import TPGroup
from pdserve.engine.parallel.step_plan import StepPlan, StepPlanError
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.engine.shard_engine import ShardEngine
from tests.support.tp_ranks import run_ranks

PLAN = StepPlan([5, 6, 7], [0, 1, 2], [3], [3], [[4]], ["a"], [2], [0])


def test_attachments_round_trip_and_default_to_none() -> None:
    plan = dataclasses.replace(PLAN, attachments={"a": {"routes": [{"sender_rank": 1}],
                                                        "block_ids": [4]}})
    decoded = StepPlan.decode(plan.encode())
    assert [list(table) for table in decoded.block_tables] == plan.block_tables
    assert dataclasses.replace(decoded, block_tables=plan.block_tables) == plan
    assert StepPlan.decode(PLAN.encode()).attachments == {}


def test_attachments_that_are_not_a_map_are_refused() -> None:
    fields = msgpack.unpackb(PLAN.encode())
    fields[-1] = [1, 2]
    with pytest.raises(StepPlanError, match="attachments must be a map"):
        StepPlan.decode(msgpack.packb(fields, use_bin_type=True))


@pytest.mark.parametrize("payload", [{"block_tables": []}, "plan", [[1], [2]]])
def test_plans_of_the_wrong_shape_are_refused(payload: object) -> None:
    with pytest.raises(StepPlanError, match="cannot decode a step plan"):
        StepPlan.decode(msgpack.packb(payload, use_bin_type=True))
    fields = msgpack.unpackb(PLAN.encode())
    fields[4] = [[4]]  # a block table as a list of ints, not int64 bytes
    with pytest.raises(StepPlanError, match="int64 bytes"):
        StepPlan.decode(msgpack.packb(fields, use_bin_type=True))


def _run(path: str, tp: TPGroup, prompts: list[list[int]]) -> object:
    config = engine_config(path, num_kv_blocks=64, block_size=4, max_num_batched_tokens=24)
    if not tp.is_first:
        seen: list[tuple[int, dict[str, int], dict[str, object]]] = []
        shard = ShardEngine(config, tp)

        def hook(layer: int, plan: StepPlan) -> None:
            if plan.attachments:
                seen.append((layer, dict(zip(plan.request_ids, plan.seq_lens, strict=True)),
                             plan.attachments))

        shard.run(hook)
        return seen, shard.loaded.config.num_layers
    engine = LLMEngine(config, tp=tp)
    attached: list[dict[str, dict[str, int]]] = []

    def attach(output: SchedulerOutput) -> dict[str, Any]:
        # Each sampling chunk's context length, as a worker would attach its routes.
        data = {c.request.request_id: {"seq_len": c.end_position}
                for c in output.chunks if c.samples and c.end_position > 1 + c.start_position}
        attached.append(data)
        return data

    engine.runner.attach = attach
    try:
        engine.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        return attached
    finally:
        engine.stop_ranks()


def test_every_rank_sees_each_step_s_attachments_on_every_layer(
        tiny_checkpoints: dict[str, str]) -> None:
    prompts = [list(range(3, 43)), list(range(50, 59))]  # 40 tokens: chunked over steps
    attached, (seen, num_layers) = run_ranks(2, lambda tp: _run(tiny_checkpoints["llama"], tp,
                                                                prompts))
    sent = [a for a in attached if a]
    # Each prompt attached once, in the step of its last chunk (then decode rows: 1 token).
    assert sorted(d["seq_len"] for a in sent for d in a.values()) == [9, 40]
    assert [layer for layer, _, _ in seen] == list(range(num_layers)) * len(sent)
    for step, attachment in enumerate(sent):  # the step it was attached to: its context
        for _, seq_lens, got in seen[step * num_layers:(step + 1) * num_layers]:
            assert got == attachment
            assert all(seq_lens[rid] == data["seq_len"] for rid, data in got.items())
