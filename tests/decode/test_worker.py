"""The decode worker without Ray: a prompt whose KV finds no free blocks within
handoff.reserve_timeout_s is refused saying so, and the load it reports counts the
reservation, in the one record Serve hands to every reader."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator

import pytest

from pdserve.cluster.config import engine_config
from pdserve.decode.api import DecodeCapacityError, DecodeRequest
from pdserve.decode.worker import DecodeWorker
from pdserve.engine.sampling_params import SamplingParams
from pdserve.planes.token_wire import TokenSink
from pdserve.replica import WorkerLoad

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
NUM_BLOCKS, BLOCK_SIZE = 8, 16
RESERVE_TIMEOUT_S = 1.0
SINK = TokenSink("127.0.0.1", 1, "unused: no token leaves in these tests")


@pytest.fixture
def worker(tiny_checkpoints: dict[str, str]) -> Iterator[DecodeWorker]:
    config = engine_config(tiny_checkpoints["llama"], num_kv_blocks=NUM_BLOCKS,
                           block_size=BLOCK_SIZE, device="cpu")
    decode = DecodeWorker(config, None, "a-cluster-token-0123456789", RESERVE_TIMEOUT_S)
    yield decode
    decode.async_engine.shutdown()


def test_a_reservation_that_finds_no_room_in_time_is_refused(worker: DecodeWorker) -> None:
    held = DecodeRequest("held", list(range(100, 200)), PARAMS, local_prefill=False, sink=SINK)
    late = DecodeRequest("late", list(range(300, 400)), PARAMS, local_prefill=False, sink=SINK)

    async def run() -> tuple[WorkerLoad | None, BaseException]:
        slots = await worker._reserve(held)  # 7 of the 8 blocks, awaiting KV
        assert len(slots.block_ids) == 7
        load = WorkerLoad.from_stats(worker.record_routing_stats())
        with pytest.raises(DecodeCapacityError) as refused:
            await worker._reserve(late)
        await worker.async_engine.call(lambda: worker.engine.abort("held"))
        return load, refused.value

    load, refused = asyncio.run(run())
    assert load is not None and load.kv_events_address  # where its KV events are served
    assert dataclasses.replace(load, kv_events_address="") == WorkerLoad(
        num_blocks=NUM_BLOCKS, num_free_blocks=1, num_running=0, num_waiting=1)
    assert f"within {RESERVE_TIMEOUT_S:.0f}s" in str(refused)
    freed = WorkerLoad.from_stats(worker.record_routing_stats())
    assert freed is not None and freed.num_free_blocks == NUM_BLOCKS
