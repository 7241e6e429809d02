"""Choices of one request: seeds per choice, the admission gate counting them, and the
asyncio helpers that run them side by side (merged streams, gather that cancels)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import suppress

import pytest

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.sampling_params import MAX_SEED, MIN_SEED, SamplingParams
from pdserve.router.admission import AdmissionGate
from pdserve.router.choices import choice_params, gather_or_cancel, merged
from pdserve.router.errors import OverloadedError
from tests.router.ingress_stand_in import RecordingPipeline, ingress_with


def test_choice_seeds_move_on_by_the_index_and_wrap() -> None:
    params = SamplingParams(seed=10)
    assert [choice_params(params, i).seed for i in range(3)] == [10, 11, 12]
    assert choice_params(SamplingParams(seed=MAX_SEED), 1).seed == MIN_SEED
    unseeded = SamplingParams()
    assert choice_params(unseeded, 5) is unseeded


def test_admission_counts_every_choice() -> None:
    gate = AdmissionGate(4)
    gate.admit(3)
    with pytest.raises(OverloadedError):
        gate.admit(2)
    gate.admit(1)
    assert gate.num_in_flight == 4 and gate.num_rejected == 1
    with pytest.raises(InvalidRequestError, match="n=5"):
        AdmissionGate(4).admit(5)  # could never run: a 400, not a 429 to retry


async def _stream(name: str, delays: list[float], closed: list[str],
                  fail_at: int | None = None) -> AsyncIterator[str]:
    try:
        for n, delay in enumerate(delays):
            await asyncio.sleep(delay)
            if n == fail_at:
                raise RuntimeError(f"{name} broke")
            yield f"{name}{n}"
    finally:
        closed.append(name)


def test_merged_streams_interleave_by_arrival_and_say_when_each_ended() -> None:
    async def run() -> list[tuple[int, str | None]]:
        closed: list[str] = []
        streams = [_stream("a", [0.0, 0.3, 0.05], closed), _stream("b", [0.1, 0.0], closed)]
        return [item async for item in merged(streams)]

    assert asyncio.run(run()) == [(0, "a0"), (1, "b0"), (1, "b1"), (1, None), (0, "a1"),
                                  (0, "a2"), (0, None)]


def test_a_failing_stream_raises_and_the_others_are_cancelled() -> None:
    async def run() -> tuple[list[tuple[int, str | None]], list[str]]:
        closed: list[str] = []
        seen: list[tuple[int, str | None]] = []
        slow = _stream("slow", [0.0, 30.0], closed)
        with pytest.raises(RuntimeError, match="bad broke"):
            async for item in merged([slow, _stream("bad", [0.01, 0.01], closed, fail_at=1)]):
                seen.append(item)
        return seen, closed

    seen, closed = asyncio.run(run())
    assert seen == [(0, "slow0"), (1, "bad0")]
    assert sorted(closed) == ["bad", "slow"]  # the 30 s stream did not keep running


def test_a_consumer_that_stops_early_cancels_every_stream() -> None:
    async def run() -> list[str]:
        closed: list[str] = []
        streams = merged([_stream("x", [0.0, 30.0], closed), _stream("y", [30.0], closed)])
        async for _ in streams:
            break
        await streams.aclose()  # type: ignore[attr-defined]
        return closed

    assert sorted(asyncio.run(run())) == ["x", "y"]


def test_gather_or_cancel_cancels_the_rest_on_a_failure() -> None:
    async def run() -> list[str]:
        cancelled: list[str] = []

        async def waits() -> None:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.append("waits")
                raise

        async def fails() -> None:
            await asyncio.sleep(0.01)
            raise ValueError("no")

        with pytest.raises(ValueError):
            await gather_or_cancel([waits(), fails()])
        assert await gather_or_cancel([asyncio.sleep(0, "a"), asyncio.sleep(0, "b")]) == ["a", "b"]
        return cancelled

    assert asyncio.run(run()) == ["waits"]


def test_each_choice_runs_under_its_own_id_and_seed(tiny_checkpoints: dict[str, str]) -> None:
    pipeline = RecordingPipeline()
    ingress = ingress_with(tiny_checkpoints["llama"], pipeline)
    body = json.dumps({"model": "tiny", "prompt": "hi", "n": 3, "seed": 5, "max_tokens": 1})
    response = asyncio.run(ingress.completion(body.encode()))
    data = json.loads(bytes(response.body))
    rid = data["id"]
    assert pipeline.calls == [(f"{rid}-0", 5), (f"{rid}-1", 6), (f"{rid}-2", 7)]
    assert [c["text"] for c in data["choices"]] == [f"<{rid}-{i}>" for i in range(3)]
    assert data["usage"]["completion_tokens"] == 3 and ingress.admission.num_in_flight == 0


@pytest.mark.parametrize("asgi_version", ["2.4", "2.0"])
def test_a_client_gone_before_the_first_chunk_still_ends_every_choice(
        tiny_checkpoints: dict[str, str], asgi_version: str) -> None:
    """Starlette never starts a stream's body when the client leaves while the headers go
    out (2.4: the send fails; 2.0: the disconnect wins the race): the choices must still be
    closed (the workers stop) and their admission returned."""
    pipeline = RecordingPipeline(hang=True)
    ingress = ingress_with(tiny_checkpoints["llama"], pipeline)
    body = json.dumps({"model": "tiny", "prompt": "hi", "n": 2, "stream": True})

    async def run() -> None:
        response = await ingress.completion(body.encode())
        assert ingress.admission.num_in_flight == 2 and pipeline.closed == []

        async def receive() -> dict[str, str]:
            return {"type": "http.disconnect"}

        async def send(message: dict[str, object]) -> None:
            if asgi_version == "2.4":
                raise OSError("connection reset by peer")
            await asyncio.Event().wait()  # the headers never leave

        scope = {"type": "http", "asgi": {"spec_version": asgi_version}}
        with suppress(Exception):
            await response(scope, receive, send)  # type: ignore[arg-type]

    asyncio.run(run())
    assert sorted(pipeline.closed) == sorted(call[0] for call in pipeline.calls)
    assert len(pipeline.closed) == 2 and ingress.admission.num_in_flight == 0
