"""The decode worker: reserves blocks for incoming KV, waits for the fence, decodes in a batch.

It also prefills locally: short prompts, colocated mode, and the recompute fallback.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from pdserve.decode.api import DecodeCapacityError, DecodeEvent, DecodeRequest
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.cpu_affinity import apply_cpu_settings
from pdserve.engine.engine import LLMEngine, ReceivedKVSlots, RequestOutput
from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.request import RequestMode
from pdserve.handoff import HandoffConfig, HandoffError, HandoffReceiver, HandoffTransport
from pdserve.log import configure_logging
from pdserve.replica import replica_id

logger = logging.getLogger(__name__)


def tokens_event(out: RequestOutput, prefilled_here: bool = True) -> DecodeEvent:
    """``prefilled_here``: this worker computed the prompt, so its prefix-cache hits saved
    compute (received KV: the prefill worker reports those)."""
    return DecodeEvent(
        kind="tokens", token_ids=out.new_token_ids, logprobs=out.logprobs, text=out.new_text,
        finished=out.finished, finish_reason=out.finish_reason,
        num_output_tokens=out.num_output_tokens,
        num_cached_tokens=out.num_cached_tokens if prefilled_here else 0,
    )


def handoff_error_kind(exc: HandoffError) -> str:
    """HandoffTimeoutError -> "timeout", HandoffPeerGoneError -> "peer_gone", ..."""
    name = type(exc).__name__.removeprefix("Handoff").removesuffix("Error") or "other"
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


class DecodeWorker:
    """One decode replica: an engine on its own thread plus a handoff receiver.

    Block lifetime on this side: `reserve_for_received_kv` makes the request own its blocks;
    the receiver writes only into them until the ticket is ready, failed or cancelled; only
    after `cancel` returns (no more writes) may the engine free them.
    """

    def __init__(self, engine_config: EngineConfig, handoff_config: HandoffConfig | None) -> None:
        configure_logging()
        self.cpu_claim = apply_cpu_settings(engine_config, "decode")  # before any engine thread
        self.engine = LLMEngine(engine_config)
        self.async_engine = AsyncEngine(self.engine)
        self.reserve_timeout_s = handoff_config.default_timeout_s if handoff_config else 30.0
        self.transport: HandoffTransport | None = None
        self.receiver: HandoffReceiver | None = None
        if handoff_config is not None:
            self.transport = HandoffTransport(handoff_config).start()
            self.receiver = HandoffReceiver(self.transport, self.engine.kv_cache,
                                            self.engine.layout,
                                            staging_bytes=self.engine.staging_bytes or None)
        logger.info("decode worker ready: %s", self.engine.describe())

    async def generate(self, request: DecodeRequest) -> AsyncIterator[DecodeEvent]:
        if request.local_prefill or self.receiver is None:
            async for out in self.async_engine.generate(
                request.request_id, request.prompt_token_ids, request.sampling_params,
                RequestMode.FULL, request.resume_output_ids, request.stream_interval_s,
            ):
                yield tokens_event(out)
            return
        async for event in self._generate_from_received_kv(request):
            yield event

    async def _generate_from_received_kv(
            self, request: DecodeRequest) -> AsyncIterator[DecodeEvent]:
        assert self.receiver is not None
        rid = request.request_id
        stream = self.async_engine.open_stream(rid)
        finished = False
        start = time.monotonic()
        try:
            # Inside the try: a caller that leaves while the reservation is being made must
            # not strand the blocks (abort below frees whatever was reserved).
            slots = await self._reserve(request)
            ticket = self.receiver.reserve(
                rid, slots.block_ids, self.engine.layout,
                len(request.prompt_token_ids) - slots.num_cached_tokens)
            yield DecodeEvent(kind="ticket", ticket=ticket.to_dict(),
                              num_cached_tokens=slots.num_cached_tokens)
            try:
                fence = await self.receiver.wait_ready_async(rid)
            except HandoffError as exc:
                logger.warning("handoff for %s failed: %s", rid, exc)
                finished = True
                await self.async_engine.call(lambda: self.engine.abort(rid))
                yield DecodeEvent(kind="handoff_failed", reason=str(exc),
                                  error_kind=handoff_error_kind(exc))
                return
            first = await self.async_engine.call(
                lambda: self.engine.activate_received(rid, fence.first_token_id))
            wait_s = time.monotonic() - start
            yield DecodeEvent(kind="tokens", finished=first.finished,
                              finish_reason=first.finish_reason,
                              num_output_tokens=first.num_output_tokens, handoff_wait_s=wait_s,
                              handoff_bytes=fence.num_bytes)
            finished = first.finished
            if not finished:
                async for out in self.async_engine.stream(rid, stream,
                                                          request.stream_interval_s):
                    finished = out.finished
                    yield tokens_event(out, prefilled_here=False)
        finally:
            if not finished:
                # Cancelled (client gone) or crashed: stop the receiver writing before freeing.
                self.receiver.cancel(rid)
            await self.async_engine.close_stream(rid, abort=not finished)

    async def _reserve(self, request: DecodeRequest) -> ReceivedKVSlots:
        """Blocks for the prompt's KV (after any prefix this worker still caches), waiting
        (bounded) while running requests hold them."""
        deadline = time.monotonic() + self.reserve_timeout_s
        delay = 0.005
        while True:
            slots = await self.async_engine.call(lambda: self.engine.reserve_for_received_kv(
                request.request_id, request.prompt_token_ids, request.sampling_params))
            if slots is not None:
                return slots
            if time.monotonic() + delay > deadline:
                raise DecodeCapacityError(
                    f"decode worker found no room for {len(request.prompt_token_ids)} prompt "
                    f"tokens within {self.reserve_timeout_s:.0f}s; retry later")
            await asyncio.sleep(delay)  # blocks free as running requests finish
            delay = min(delay * 2, 0.1)

    async def kv_stats(self) -> dict[str, Any]:
        """Block and queue counts (integrity-checked on the engine thread)."""
        return asdict(await self.async_engine.call(self.engine.kv_stats))

    def handoff_stats(self) -> dict[str, Any]:
        """The KV receiver's counters (pieces landed and drained; transfers by outcome)."""
        return {} if self.receiver is None else asdict(self.receiver.stats())

    def role_stats(self) -> dict[str, Any]:
        """This replica's KV use and queues for the ingress's health and metrics (read
        without the engine thread: counters only, no integrity check)."""
        kv, sched = self.engine.kv_manager, self.engine.scheduler
        return {"replica_id": replica_id(), "num_blocks": kv.num_blocks,
                "num_free_blocks": kv.num_free_blocks, "num_running": sched.num_running,
                "num_waiting": sched.num_waiting + sched.num_awaiting_kv}

    def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve calls this periodically; the decode request router ranks replicas on it."""
        kv = self.engine.kv_manager
        return {"num_free_blocks": kv.num_free_blocks, "num_blocks": kv.num_blocks,
                "num_running": self.engine.scheduler.num_running}

    def check_health(self) -> None:
        if self.async_engine.is_dead:
            raise RuntimeError("decode engine thread died")

    def __del__(self) -> None:
        # Ray Serve calls this when the replica stops: end transfers before the engine.
        if self.receiver is not None:
            self.receiver.close()
        if self.transport is not None:
            self.transport.stop()
        self.async_engine.shutdown()
