"""The prefill worker: computes a prompt's KV, streams it layer by layer to a decode worker.

Returns the first token at once; the request's blocks stay pinned until the sends complete.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any, Protocol

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.cpu_affinity import apply_cpu_settings
from pdserve.engine.cpu_lending import lending
from pdserve.engine.engine import LLMEngine
from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.engine_outputs import RequestOutput
from pdserve.engine.replica_ranks import ONE_RANK, RankStarter
from pdserve.engine.request import RequestMode, RequestStatus
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.engine.tiers.mooncake import MooncakeSettings, connect_store
from pdserve.faults import FaultPoints
from pdserve.handoff import (
    HandoffConfig,
    HandoffSender,
    HandoffTicket,
    HandoffTransport,
    OutboundTransfer,
    SendResult,
)
from pdserve.handoff.rank_sends import route_attachment
from pdserve.handoff.routes import all_ready, route_tickets
from pdserve.log import configure_logging
from pdserve.planes.kv_event_server import serve_engine_events
from pdserve.prefill.api import PrefillRequest, PrefillResult, first_block_to_send
from pdserve.prefill.peer_kv import PeerPuller, PeerSendRequest, PeerSource, best_source
from pdserve.prefill.peer_source import send_cached
from pdserve.replica import PrefillQueue, WorkerLoad, tier_load

logger = logging.getLogger(__name__)
Routes = list[tuple[int, HandoffTicket]]  # (sender rank, ticket) per route


class ReplicaContext(Protocol):
    """What the worker learns from the framework that runs it (Serve: the app builder hands
    `cluster.serve_context.ServeReplicaContext`)."""

    def own_replica_id(self) -> str:
        """This replica's id as the ingress and routers name it ("" outside a framework)."""
        ...

    def role_handle(self) -> Any:
        """A handle that calls the prefill role's replicas (peer pulls)."""
        ...


class _Standalone:
    """Outside Serve: no replica id, no role to pull from."""

    def own_replica_id(self) -> str:
        return ""

    def role_handle(self) -> Any:
        raise RuntimeError("a prefill worker outside Serve has no role to pull prefixes from")


class RankSends(Protocol):
    """The KV sends of a prefill rank other than 0 (its actor, from rank 0's threads)."""

    def released(self, request_id: str) -> concurrent.futures.Future[Any]: ...

    def cancel(self, request_id: str, reason: str) -> None: ...


class PrefillWorker:
    """One prefill replica: an engine in prefill-only mode plus a handoff sender.

    Block lifetime on this side (deferred free): a request's blocks are pinned from its
    first chunk; its transfer starts when its last chunk runs; the blocks are released only
    when the sender's ``released`` future says no send reads them any more (sent, failed or
    cancelled). Full blocks then stay in the prefix cache. With several ranks each rank sends
    the routes it is the sender of from its own cache (`handoff.rank_sends`), and the blocks
    are released once every rank's sends are.
    """

    def __init__(self, engine_config: EngineConfig, handoff_config: HandoffConfig,
                 drain_timeout_s: float,
                 node_host: Callable[[], str] = lambda: "127.0.0.1",
                 kv_store: MooncakeSettings | None = None,
                 ranks: RankStarter = ONE_RANK,
                 context: ReplicaContext | None = None) -> None:
        """``drain_timeout_s``: how long a stopping replica waits for its transfers in flight
        (handoff.drain_timeout_s); ``node_host``: this machine's address for other nodes
        (where the KV event plane listens); ``ranks``: starts the replica's tensor-parallel
        ranks; ``context``: its replica id and role handle (None: standalone)."""
        self.context: ReplicaContext = context if context is not None else _Standalone()
        configure_logging()
        # Before any engine thread starts: threads inherit the binding.
        self.cpu_claim = apply_cpu_settings(engine_config.cpu_affinity, engine_config.num_threads,
                                            "prefill")
        self.transport = HandoffTransport(handoff_config).start()
        try:
            self.ranks, self.engine = ranks.start(
                engine_config, lambda tp: LLMEngine(engine_config, tp=tp))
        except BaseException:
            self.transport.stop()
            raise
        self.sender = HandoffSender(self.transport, device=self.engine.device)
        if kv_store is not None:  # before the engine thread starts
            client = connect_store(kv_store, node_host())
            if client is not None:
                self.engine.tiers.attach_store(client)
        self.events = serve_engine_events(self.engine, handoff_config.auth_token, node_host())
        # Pulls need one rank's whole cache on each side.
        self.puller = PeerPuller(self.transport, self.engine, self.context.role_handle) \
            if engine_config.peer_kv_pull and self.engine.tp.size == 1 else None
        # Both touched only on the engine thread (commands and the layer hook run there).
        # A ticket per route (one per decode rank's head range) and the first block to send
        # (after what the decode worker already holds); a transfer per route.
        self._tickets: dict[str, tuple[Routes, int]] = {}
        self._transfers: dict[str, list[OutboundTransfer]] = {}
        self._remote: list[RankSends] = [self.ranks.sends(rank)
                                         for rank in range(1, self.engine.tp.size)]
        if self._remote:  # the other ranks learn their routes from the step plan
            self.engine.runner.attach = self._attach
        self.faults = FaultPoints()
        if self.faults.enabled:
            self.engine.tiers.on_load = lambda: self.faults.hit("prefill.loading_kv")
        self.async_engine = AsyncEngine(self.engine, layer_hook=self._send_layer,
                                        cores=lending(engine_config, self.cpu_claim, self.engine))
        self.queue = PrefillQueue()  # replaced whole: Serve's stats thread reads it
        self.drain_timeout_s = drain_timeout_s
        logger.info("prefill worker ready: %s", self.engine.describe())

    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        rid = request.request_id
        self.faults.hit("prefill.reserved")
        tickets = self._routes(request.ticket)
        first_block = first_block_to_send(request, tickets[0][1].num_tokens,
                                          self.engine.layout.block_size)
        arrived = time.monotonic()
        first: RequestOutput | None = None
        stream = self.async_engine.open_stream(rid)
        queued = len(request.prompt_token_ids) - request.decode_cached_tokens
        self.queue = self.queue.add(queued)
        source = None
        if self.puller is not None:
            self.puller.loop = asyncio.get_running_loop()
            source = best_source(request.peer_prefixes, self.context.own_replica_id())
        try:
            await self.async_engine.call(lambda: self._admit(rid, tickets, first_block, source))
            await self.async_engine.call(lambda: self.engine.add_request(
                rid, request.prompt_token_ids, request.sampling_params, RequestMode.PREFILL_ONLY))
            async for out in self.async_engine.stream(rid, stream):
                first = out
            assert first is not None and first.new_token_ids
            transfers = await self.async_engine.call(lambda: self._transfers[rid])
        except BaseException:
            self.async_engine.submit(lambda: self._give_up(rid))
            raise
        finally:
            self.queue = self.queue.add(-queued)
            await self.async_engine.close_stream(rid, abort=False)
        self.faults.hit("prefill.layers_sent")
        for transfer in transfers:
            self.sender.send_fence(transfer, first.new_token_ids[0])
        self._when_released(rid, transfers)
        if self.faults.armed("prefill.fence_verified"):  # decode answers DONE once verified
            await asyncio.wrap_future(all_ready([t.released for t in transfers]))
            self.faults.hit("prefill.fence_verified")
        return PrefillResult(
            request_id=rid, first_token_id=first.new_token_ids[0], first_text=first.new_text,
            num_cached_tokens=first.num_cached_tokens,
            num_computed_tokens=first.num_prompt_tokens - first.num_cached_tokens,
            queue_s=first.queue_s,
            compute_s=max(0.0, time.monotonic() - arrived - first.queue_s),
            first_logprobs=first.logprobs[0] if first.logprobs else None,
            kv_reuse=first.kv_reuse,
            replica_id=self.context.own_replica_id(), queue=self.queue,
        )

    def _attach(self, output: SchedulerOutput) -> dict[str, Any]:
        """Engine thread, before a step's plan goes to the other ranks: the routes and source
        blocks of each request whose prompt completes in it."""
        attachments = {}
        for chunk in output.chunks:
            rid = chunk.request.request_id
            pending = self._tickets.get(rid) if chunk.samples else None
            if pending is not None:
                attachments[rid] = route_attachment(pending[0], self._source_blocks(rid))
        return attachments

    def _source_blocks(self, request_id: str) -> list[int]:
        tickets, first = self._tickets[request_id]
        return self.engine.kv_manager.block_ids(request_id)[first:first + tickets[0][1].num_blocks]

    def _admit(self, rid: str, tickets: Routes, first_block: int,
               source: PeerSource | None) -> None:
        """Engine thread: remember the request's tickets (and a peer caching its prefix)."""
        self._tickets[rid] = (tickets, first_block)
        if source is not None and self.puller is not None:
            self.puller.hint(rid, source)

    async def send_cached(self, ask: PeerSendRequest) -> str | None:
        """Another prefill worker pulls a prefix this one caches (`peer_kv.send_cached`).
        A call meant for another replica (gone, so the router chose another) is refused:
        peer_gone."""
        if ask.pinned_replica != self.context.own_replica_id():
            return "peer_gone"
        return await send_cached(self.async_engine, self.sender, ask)

    def _send_layer(self, layer: int, output: SchedulerOutput) -> None:
        """Engine thread, right after `layer` wrote its KV: ship it for completed prompts."""
        transfers = []
        for chunk in output.chunks:
            if not chunk.samples:
                continue  # the prompt is not complete yet: its KV is sent with the last chunk
            rid = chunk.request.request_id
            started = self._transfers.get(rid)
            if started is None:
                if rid not in self._tickets:
                    continue
                block_ids = self._source_blocks(rid)
                tickets, _ = self._tickets.pop(rid)
                started = [self.sender.start_transfer(ticket, block_ids, self.engine.layout)
                           for rank, ticket in tickets if rank == 0]
                self._transfers[rid] = started
            transfers.extend(started)
        if transfers:
            self.sender.send_layer(self.engine.kv_cache, layer, transfers)
            if layer == self.engine.layout.num_layers // 2:
                self.faults.hit("prefill.mid_layers")

    def _give_up(self, request_id: str) -> None:
        """Engine thread: the caller went away or prefill failed before the fence."""
        self._tickets.pop(request_id, None)
        if self.puller is not None:
            self.puller.forget(request_id)
        transfers = self._transfers.get(request_id)
        if transfers is None:
            self.engine.abort(request_id)  # no send ever read its blocks
            return
        for transfer in transfers:
            self.sender.cancel(transfer, "the prefill request was cancelled")
        for rank in self._remote:
            rank.cancel(request_id, "the prefill request was cancelled")
        self._when_released(request_id, transfers)

    def _routes(self, data: dict[str, Any]) -> Routes:
        """Every route of the ticket, each checked to be from one of this replica's ranks into
        KV heads that rank holds."""
        routes = route_tickets(data)
        size = self.engine.tp.size
        for rank, ticket in routes:
            if rank >= size:
                raise ValueError(f"the ticket has a route from prefill rank {rank}; this "
                                 f"prefill replica has {size} rank(s)")
            layout = dataclasses.replace(self.engine.layout, tp_rank=rank)
            layout.check_pairs_with(ticket.layout, ticket.kv.heads)
        if not any(rank == 0 for rank, _ in routes):
            raise ValueError("the ticket has no route from prefill rank 0 (which samples the "
                             "first token)")
        return routes

    def _when_released(self, request_id: str, transfers: list[OutboundTransfer]) -> None:
        """Free the request's blocks once no send of any rank's transfers reads them."""
        local = all_ready([t.released for t in transfers])
        remote = [rank.released(request_id) for rank in self._remote]
        _when_all_done([local, *remote], lambda: self._on_released(request_id, [local, *remote]))

    def _on_released(self, request_id: str,
                     done: Sequence[concurrent.futures.Future[Any]]) -> None:
        """No send reads the blocks any more; free them on the engine thread."""
        for future in done:
            error = future.exception()
            results: list[SendResult] = [] if error is not None else future.result()
            if error is not None:  # the rank died: nothing of it reads the blocks
                logger.warning("prefill rank of %s failed: %s", request_id, error)
            for result in results:
                if not result.ok:
                    logger.warning("handoff of %s failed: %s", request_id, result.error)
        self.faults.hit("prefill.releasing")
        self.async_engine.submit(lambda: self._forget(request_id))

    def _forget(self, request_id: str) -> None:
        self._transfers.pop(request_id, None)
        if self.puller is not None:
            self.puller.forget(request_id)
        request = self.engine.scheduler.get_request(request_id)
        if request is not None and request.status is RequestStatus.PREFILLED:
            self.engine.release(request_id)  # full blocks stay in the prefix cache
        else:
            self.engine.abort(request_id)

    async def kv_stats(self) -> dict[str, Any]:
        return asdict(await self.async_engine.call(self.engine.kv_stats))

    def arm_fault(self, name: str) -> None:
        """Die at the next hit of fault point ``name`` (`pdserve.faults`; tests only)."""
        self.faults.arm(name)

    def record_routing_stats(self) -> dict[str, Any]:
        """This replica's load (`WorkerLoad`), which Serve asks for on the role's timer and
        hands to the prefill request router and the ingress (counters only)."""
        kv, sched, queue = self.engine.kv_manager, self.engine.scheduler, self.queue
        return WorkerLoad(num_blocks=kv.num_blocks, num_free_blocks=kv.num_free_blocks,
                          num_running=sched.num_running, num_waiting=sched.num_waiting,
                          num_queued_tokens=queue.num_tokens, queue_seq=queue.seq,
                          kv_events_address=self.events.address,
                          num_lent_steps=self.async_engine.lent_steps,
                          **tier_load(self.engine.tiers.stats())).to_stats()

    def check_health(self) -> None:
        if self.async_engine.is_dead:
            raise RuntimeError("prefill engine thread died")
        self.ranks.check()

    def drain(self, timeout_s: float) -> int:
        """Wait (bounded) until no transfer this worker started still sends: a replica
        that Serve stops (downscale, redeploy) finishes its handoffs first. Returns how
        many were still sending at the deadline."""
        try:
            pending = self.async_engine.submit(
                lambda: [t.released for ts in self._transfers.values() for t in ts]
            ).result(timeout_s)
        except Exception:  # noqa: BLE001 - a dead engine thread has nothing left to send
            return 0
        _, not_done = concurrent.futures.wait(pending, timeout=timeout_s)
        return len(not_done)

    def __del__(self) -> None:
        # Ray Serve calls this when it stops the replica, after its last prefill call
        # returned; the KV of those calls may still be on its way.
        left = self.drain(self.drain_timeout_s)
        if left:
            logger.warning("stopping with %d KV transfer(s) still sending; decode will "
                           "recompute them", left)
        self.events.close()
        self.sender.close()
        if self.puller is not None:
            self.puller.receiver.close()
        self.transport.stop()
        self.async_engine.shutdown()
        self.ranks.close()


def _when_all_done(futures: Sequence[concurrent.futures.Future[Any]],
                   callback: Callable[[], None]) -> None:
    """``callback()`` once every future is done, whether it succeeded or failed."""
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_: concurrent.futures.Future[Any]) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            callback()

    for future in futures:
        future.add_done_callback(one_done)
