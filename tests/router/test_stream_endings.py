"""How a stream that does not finish is ended and counted: by its deadline (`timeout`, whether
its client reads or not) or because its client stopped reading (`stalled`); either way its
choices are closed and their admission returned.

A real `Ingress` on a stand-in pipeline; the response is driven as the server drives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from pdserve.router.delta import GenerationDelta
from pdserve.router.ingress import Ingress
from pdserve.router.stalls import StallSettings
from tests.router.ingress_stand_in import RecordingPipeline, ingress_with

STREAM = json.dumps({"model": "tiny", "prompt": "hi", "stream": True}).encode()


class EndlessPipeline(RecordingPipeline):
    """Each choice yields a token every 10 ms until closed."""

    async def deltas(self, request_id: str) -> AsyncIterator[GenerationDelta]:
        while True:
            yield GenerationDelta("tok ", [1])
            await asyncio.sleep(0.01)


def statuses(ingress: Ingress) -> dict[str, float]:
    prefix = "pdserve:requests_total{"
    counts: dict[str, float] = {}
    for line in ingress.metrics.render().decode().splitlines():
        if line.startswith(prefix):
            status = line.split('status="')[1].split('"')[0]
            counts[status] = counts.get(status, 0.0) + float(line.split()[-1])
    return counts


async def serve_stream(ingress: Ingress, read_body_messages: int | None) -> list[bytes]:
    """Send the response as a server does; the client reads the first ``read_body_messages``
    body messages, then stops reading (None: reads everything)."""
    response = await ingress.completion(STREAM)
    body: list[bytes] = []

    async def receive() -> dict[str, str]:
        await asyncio.Event().wait()  # the client stays connected
        return {"type": "http.disconnect"}

    async def send(message: dict[str, object]) -> None:
        if message["type"] == "http.response.body":
            if read_body_messages is not None and len(body) >= read_body_messages:
                await asyncio.Event().wait()  # flow control: this send never completes
            body.append(bytes(message.get("body", b"")))  # type: ignore[arg-type]

    scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
    # a stalled stream's task is cancelled: the server sees the same
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(response(scope, receive, send), 10)  # type: ignore[arg-type]
    return body


def test_a_stream_past_its_deadline_ends_with_an_error_event_counted_as_timeout(
        tiny_checkpoints: dict[str, str]) -> None:
    pipeline = RecordingPipeline(hang=True)
    ingress = ingress_with(tiny_checkpoints["llama"], pipeline, request_timeout_s=0.3)
    body = b"".join(asyncio.run(serve_stream(ingress, None))).decode()
    assert '"code":"timeout"' in body and body.endswith("data: [DONE]\n\n")
    assert statuses(ingress) == {"timeout": 1.0}
    assert pipeline.closed and ingress.admission.num_in_flight == 0


def test_a_deadline_passing_while_the_client_does_not_read_counts_as_timeout(
        tiny_checkpoints: dict[str, str]) -> None:
    """The error event cannot be sent to a client that stopped reading: the stall watch ends
    the stream, which still counts as what ended it first, its deadline."""
    pipeline = RecordingPipeline(hang=True)
    ingress = ingress_with(tiny_checkpoints["llama"], pipeline, request_timeout_s=0.3,
                           stalls=StallSettings(0.4, 8 << 20))
    asyncio.run(serve_stream(ingress, read_body_messages=1))
    assert statuses(ingress) == {"timeout": 1.0}
    assert pipeline.closed and ingress.admission.num_in_flight == 0


def test_a_client_that_stops_reading_is_ended_and_counted_as_stalled(
        tiny_checkpoints: dict[str, str]) -> None:
    pipeline = EndlessPipeline()
    ingress = ingress_with(tiny_checkpoints["llama"], pipeline,
                           stalls=StallSettings(0.4, 8 << 20))
    body = asyncio.run(serve_stream(ingress, read_body_messages=3))
    assert len(body) == 3
    assert statuses(ingress) == {"stalled": 1.0} and ingress.stalls.num_stalled == 1
    assert pipeline.closed and ingress.admission.num_in_flight == 0
