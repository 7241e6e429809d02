"""The decode worker: reserves blocks for incoming KV, waits for the fence, decodes in a batch.

It also prefills locally: short prompts, colocated mode, and the recompute fallback.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import asdict
from typing import Any

from pdserve.decode.api import (
    DecodeCapacityError,
    DecodeEvent,
    DecodeRequest,
    HandoffFailed,
    KVArrived,
    KVTicket,
)
from pdserve.decode.group_receiver import GroupReceiver
from pdserve.decode.token_publisher import TokenPublisher
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.cpu_affinity import apply_cpu_settings
from pdserve.engine.cpu_lending import lending
from pdserve.engine.engine import LLMEngine
from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.engine_outputs import ReceivedKVSlots, RequestOutput
from pdserve.engine.errors import InconsistentKVError
from pdserve.engine.replica_ranks import ONE_RANK, RankStarter
from pdserve.engine.request import RequestMode
from pdserve.engine.tiers.mooncake import MooncakeSettings, connect_store
from pdserve.faults import FaultPoints
from pdserve.handoff import HandoffConfig, HandoffError, HandoffReceiver, HandoffTransport
from pdserve.log import configure_logging
from pdserve.planes.kv_event_server import serve_engine_events
from pdserve.replica import WorkerLoad, tier_load

logger = logging.getLogger(__name__)


# What a decode replica may leave unread in its connection to one ingress before it counts
# that ingress as stuck: ~100k steps' worth of a full batch's tokens.
MAX_UNREAD_TOKEN_BYTES = 64 * 2**20


class DecodeWorker:
    """One decode replica: an engine on its own thread, a handoff receiver, and the token
    plane's publisher that streams every request's tokens to its ingress.

    Block lifetime on this side: `reserve_for_received_kv` makes the request own its blocks;
    the receiver writes only into them until the ticket is ready, failed or cancelled; only
    after `cancel` returns (no more writes) may the engine free them.
    """

    def __init__(self, engine_config: EngineConfig, handoff_config: HandoffConfig | None,
                 plane_token: str, reserve_timeout_s: float,
                 node_host: Callable[[], str] = lambda: "127.0.0.1",
                 kv_store: MooncakeSettings | None = None,
                 ranks: RankStarter = ONE_RANK, sender_tp_size: int = 1) -> None:
        """``handoff_config`` None: no KV arrives (colocated); ``reserve_timeout_s``: how long
        a prompt whose KV is coming waits for free blocks (handoff.reserve_timeout_s);
        ``node_host``: this machine's address for other nodes (the KV event plane's);
        ``ranks``: starts the replica's tensor-parallel ranks; ``sender_tp_size``: the prefill
        replicas' (each of their ranks sends the KV heads it holds)."""
        configure_logging()
        # Before any engine thread starts: threads inherit the binding.
        self.cpu_claim = apply_cpu_settings(engine_config.cpu_affinity, engine_config.num_threads,
                                            "decode")
        self.ranks, self.engine = ranks.start(
            engine_config, lambda tp: LLMEngine(engine_config, tp=tp))
        if kv_store is not None:  # before the engine thread starts
            client = connect_store(kv_store, node_host())
            if client is not None:
                self.engine.tiers.attach_store(client)
        self.publisher = TokenPublisher(plane_token, MAX_UNREAD_TOKEN_BYTES)
        self.faults = FaultPoints()
        sink = _FaultingSink(self.publisher, self.faults) if self.faults.enabled \
            else self.publisher
        self.async_engine = AsyncEngine(self.engine, step_sink=sink,
                                        cores=lending(engine_config, self.cpu_claim, self.engine))
        self.events = serve_engine_events(self.engine, plane_token, node_host())
        self.reserve_timeout_s = reserve_timeout_s
        self.transport: HandoffTransport | None = None
        self.receiver: HandoffReceiver | None = None
        self.group: GroupReceiver | None = None
        if handoff_config is not None:
            self.transport = HandoffTransport(handoff_config).start()
            self.receiver = HandoffReceiver(self.transport, self.engine.kv_cache,
                                            self.engine.layout)
            self.group = GroupReceiver(self.receiver, self.engine.layout, sender_tp_size,
                                       self.ranks.receiver, handoff_config.timeout_s)
        logger.info("decode worker ready: %s", self.engine.describe())

    async def generate(self, request: DecodeRequest) -> AsyncIterator[DecodeEvent]:
        """Run ``request``, its tokens going to ``request.sink``; yields its lifecycle events
        (a received-KV request's ticket and KV outcome) and ends when the request does.
        Cancelled or failed before the end, the request stops and frees its blocks."""
        rid = request.request_id
        local = request.local_prefill or self.group is None
        done = await self.publisher.open(rid, request.sink, report_cached=local)
        finished = False
        try:
            if local:
                await self.async_engine.call(lambda: self.engine.add_request(
                    rid, request.prompt_token_ids, request.sampling_params, RequestMode.FULL,
                    request.resume_output_ids))
            else:
                async with aclosing(self._receive_kv(request)) as events:
                    async for event in events:
                        yield event
                        if isinstance(event, HandoffFailed):
                            finished = True  # the receiver and the engine let go already
                            return
            await done
            finished = True
        finally:
            self.publisher.close(rid)
            if not finished:
                # Cancelled (client or ingress gone) or crashed: stop the receiver writing
                # before the engine frees the blocks.
                if self.group is not None:
                    await self.group.cancel(rid)
                if not self.async_engine.is_dead:
                    await self.async_engine.call(lambda: self.engine.abort(rid))

    async def _receive_kv(self, request: DecodeRequest) -> AsyncGenerator[DecodeEvent, None]:
        """Reserve blocks, hand out the ticket, wait for the fence, join the batch."""
        assert self.group is not None
        rid = request.request_id
        start = time.monotonic()
        slots = await self._reserve(request)
        ticket = await self.group.reserve(
            rid, slots.block_ids, len(request.prompt_token_ids) - slots.num_cached_tokens)
        yield KVTicket(ticket, slots.num_cached_tokens)
        self.faults.hit("decode.awaiting_kv")
        try:
            fence = await self.group.wait_ready(rid)
        except HandoffError as exc:
            logger.warning("handoff for %s failed: %s", rid, exc)
            await self.async_engine.call(lambda: self.engine.abort(rid))
            yield HandoffFailed(str(exc), exc.code)
            return
        self.faults.hit("decode.fence_verified")
        # Before the first step: the ingress should hear of it before the tokens that follow.
        yield KVArrived(time.monotonic() - start, fence.num_bytes)
        try:
            first = await self.async_engine.call(
                lambda: self.engine.activate_received(rid, fence.first_token_id))
        except InconsistentKVError as exc:  # nothing sampled from it: recompute instead
            logger.error("%s; recomputing it", exc)
            await self.async_engine.call(lambda: self.engine.abort(rid))
            yield HandoffFailed(str(exc), "inconsistent")
            return
        if first.finished:  # the prefill's token ended it: no step will report the end
            # The prefill worker showed that token already; only the end is news.
            self.publisher.publish([dataclasses.replace(first, new_token_ids=[], logprobs=[])])

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

    def arm_fault(self, name: str) -> None:
        """Die at the next hit of fault point ``name`` (`pdserve.faults`; tests only)."""
        self.faults.arm(name)

    def handoff_stats(self) -> dict[str, Any]:
        """The KV receiver's counters (pieces landed and drained; transfers by outcome)."""
        return {} if self.receiver is None else asdict(self.receiver.stats())

    def record_routing_stats(self) -> dict[str, Any]:
        """This replica's load (`WorkerLoad`), which Serve asks for on the role's timer and
        hands to the decode request router and the ingress (counters read without the
        engine thread: no integrity check)."""
        kv, sched = self.engine.kv_manager, self.engine.scheduler
        allowance = sched.prompt_allowance
        return WorkerLoad(num_blocks=kv.num_blocks, num_free_blocks=kv.num_free_blocks,
                          num_running=sched.num_running,
                          num_waiting=sched.num_waiting + sched.num_awaiting_kv,
                          kv_events_address=self.events.address,
                          lend_tokens_per_s=allowance.lend_tokens_per_s(),
                          prompt_token_us=allowance.token_us(),
                          num_lent_steps=self.async_engine.lent_steps,
                          **tier_load(self.engine.tiers.stats())).to_stats()

    def token_plane_stats(self) -> dict[str, Any]:
        """Frames and entries sent, against the engine's steps (a frame per step per ingress
        at most)."""
        return asdict(self.publisher.stats) | {"num_engine_steps": self.engine.stats.num_steps}

    def check_health(self) -> None:
        if self.async_engine.is_dead:
            raise RuntimeError("decode engine thread died")
        self.ranks.check()

    def __del__(self) -> None:
        # Ray Serve calls this when the replica stops: end transfers before the engine.
        self.events.close()
        if self.receiver is not None:
            self.receiver.close()
        if self.transport is not None:
            self.transport.stop()
        self.async_engine.shutdown()
        self.ranks.close()


class _FaultingSink:
    """The token publisher behind the `decode.decoding` fault point (worker processes with
    fault points enabled only): dies before publishing a step in which a request has more
    than two output tokens."""

    def __init__(self, publisher: TokenPublisher, faults: FaultPoints) -> None:
        self.publisher = publisher
        self.faults = faults

    def put_step(self, outputs: list[RequestOutput]) -> None:
        if any(out.num_output_tokens > 2 for out in outputs):
            self.faults.hit("decode.decoding")
        self.publisher.put_step(outputs)

    def fail_all(self, exc: BaseException) -> None:
        self.publisher.fail_all(exc)
