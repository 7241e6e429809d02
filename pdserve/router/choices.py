"""The choices of one request (``n``): each its own run through the pipeline with its own
trace and outcome, and the helpers that run them side by side and merge their streams.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field, replace
from typing import TypeVar

from pdserve.engine.logprobs import TokenLogprobs
from pdserve.engine.sampling_params import MAX_SEED, MIN_SEED, SamplingParams
from pdserve.engine.tiers.cost import KVReuse
from pdserve.router.delta import GenerationDelta
from pdserve.router.timings import RequestTrace

T = TypeVar("T")


@dataclass
class ChoiceOutcome:
    """What one choice produced so far."""

    text: str = ""
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str = "stop"
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Seconds between tokens as they arrived; tokens of one delta share its gap evenly.
    token_gaps: list[float] = field(default_factory=list)
    kv_reuse: KVReuse | None = None

    def record(self, delta: GenerationDelta, now: float) -> None:
        if delta.token_ids:
            if self.num_output_tokens == 0:
                self.first_token_at = now
            else:
                gap = (now - self.last_token_at) / len(delta.token_ids)
                self.token_gaps.extend([gap] * len(delta.token_ids))
            self.last_token_at = now
        self.text += delta.text
        self.logprobs += delta.logprobs
        self.num_output_tokens += len(delta.token_ids)
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        if delta.kv_reuse is not None:
            self.kv_reuse = delta.kv_reuse
        if delta.finished and delta.finish_reason:
            self.finish_reason = delta.finish_reason


@dataclass
class ChoiceRun:
    """One choice: its index in the response, trace, stream of deltas and outcome."""

    index: int
    trace: RequestTrace
    deltas: AsyncGenerator[GenerationDelta, None]  # closed (aclose) when the choice ends
    outcome: ChoiceOutcome = field(default_factory=ChoiceOutcome)
    status: str | None = None  # set once, when the choice ended (its trace is then logged)
    stop_reason: str | None = None  # why the server ended it early (its status then says so)


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index``'s sampling: a given seed moves on by the index (choices differ and
    still reproduce); without a seed each choice draws from its own random seed anyway."""
    if index == 0 or params.seed is None:
        return params
    span = MAX_SEED - MIN_SEED + 1
    return replace(params, seed=(params.seed - MIN_SEED + index) % span + MIN_SEED)


def choice_request_id(request_id: str, index: int, num_choices: int) -> str:
    """The id the workers know a choice by (unique per choice; the request's own for n=1)."""
    return request_id if num_choices == 1 else f"{request_id}-{index}"


async def gather_or_cancel(awaitables: Sequence[Awaitable[T]]) -> list[T]:
    """All results in order; the first failure cancels the rest (awaited) and is raised."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def merged(streams: Sequence[AsyncIterator[T]],
                 buffer: int = 8) -> AsyncIterator[tuple[int, T | None]]:
    """Items of several streams as they arrive, as (stream position, item), and
    (position, None) once that stream ended. A failing stream's error is raised here and the
    other streams are cancelled; so are all of them when the consumer stops early. The
    bounded buffer keeps the producers' pace tied to the consumer's."""
    if len(streams) == 1:  # one choice (the common case): no task, no queue
        try:
            async for item in streams[0]:
                yield 0, item
            yield 0, None
        finally:
            aclose = getattr(streams[0], "aclose", None)
            if aclose is not None:
                await aclose()
        return
    queue: asyncio.Queue[tuple[int, T | None, BaseException | None]] = asyncio.Queue(
        buffer * len(streams))

    async def pump(position: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((position, item, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((position, None, exc))
            return
        await queue.put((position, None, None))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            position, item, error = await queue.get()
            if error is not None:
                raise error
            if item is None:
                remaining -= 1
            yield position, item
    finally:
        for task in tasks:
            task.cancel()
        with suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
