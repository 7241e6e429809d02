"""One tensor-parallel rank other than 0, as a Ray actor: it joins its replica's group, builds
its `ShardEngine` (its share of the model and of the KV cache) and runs rank 0's steps; on a
decode replica it also receives the KV heads it holds, on a prefill replica it sends them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Sequence
from typing import Any

from pdserve.engine.cpu_affinity import apply_cpu_settings
from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.parallel.group import Rendezvous, connect_group
from pdserve.engine.parallel.step_plan import StepPlan
from pdserve.engine.shard_engine import ShardEngine
from pdserve.handoff import HandoffConfig, HandoffReceiver, HandoffSender, HandoffTransport
from pdserve.handoff.rank_sends import RankSends
from pdserve.handoff.ticket import FenceInfo, SendResult
from pdserve.log import configure_logging

logger = logging.getLogger(__name__)


class TPRank:
    """Constructed while rank 0 constructs its engine (loading and KV sizing are collectives
    both take part in); its step loop runs on a thread from then on. An asyncio actor: rank 0
    holds `wait_stopped` open, and one `wait_ready` per transfer, beside other calls."""

    def __init__(self, config: EngineConfig, rendezvous: Rendezvous, rank: int,
                 collective_timeout_s: float, role: str,
                 handoff: HandoffConfig | None = None) -> None:
        configure_logging()
        # Before the engine starts threads: they inherit the binding.
        self.cpu_claim = apply_cpu_settings(config.cpu_affinity, config.num_threads, role)
        self.rank = rank
        self.group = connect_group(rendezvous, rank, config.resolve_device(),
                                   collective_timeout_s)
        self.shard = ShardEngine(config, self.group)
        self.transport: HandoffTransport | None = None
        self.receiver: HandoffReceiver | None = None
        self.sends: RankSends | None = None
        if handoff is not None:
            self.transport = HandoffTransport(handoff).start()
        if self.transport is not None and role == "decode":
            self.receiver = HandoffReceiver(self.transport, self.shard.kv_cache,
                                            self.shard.layout)
        if self.transport is not None and role == "prefill":
            sender = HandoffSender(self.transport, device=self.shard.device)
            self.sends = RankSends(sender, self.shard.kv_cache, self.shard.layout,
                                   self.shard.loaded.config.num_layers)
        self._stopped: concurrent.futures.Future[str] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, name=f"pdserve-rank-{rank}",
                                        daemon=True)
        self._thread.start()
        logger.info("%s rank ready: %s", role, self.shard.describe())

    async def describe(self) -> str:
        return self.shard.describe()

    async def wait_stopped(self) -> str:
        """Returns once the step loop ended: "" when rank 0 told it to stop, else why it
        failed (rank 0 holds this call open to learn of it)."""
        return await asyncio.wrap_future(self._stopped)

    # ---- decode: this rank's share of each received request's KV --------------------------
    async def reserve(self, request_id: str, block_ids: Sequence[int], num_tokens: int,
                      deadline: float, kv_heads: tuple[int, int]) -> dict[str, Any]:
        """Reserve ``kv_heads`` of ``block_ids`` (rank 0's scheduler chose them: every rank
        has the same blocks) for one route; its ticket as a dict."""
        ticket = self._receiver().reserve(request_id, block_ids, self.shard.layout, num_tokens,
                                          deadline, kv_heads)
        return ticket.to_dict()

    async def wait_ready(self, request_id: str) -> FenceInfo:
        return await self._receiver().wait_ready_async(request_id)

    async def cancel(self, request_id: str) -> bool:
        return self._receiver().cancel(request_id)

    async def handoff_stats(self) -> Any:
        return self._receiver().stats()

    # ---- prefill: the routes this rank sends -----------------------------------------------
    async def wait_released(self, request_id: str) -> list[SendResult]:
        """Once no send of this rank reads ``request_id``'s blocks (rank 0 then frees them)."""
        sends = self._sends()
        try:
            return await asyncio.wrap_future(sends.released(request_id))
        finally:
            sends.forget(request_id)

    async def cancel_sends(self, request_id: str, reason: str) -> None:
        self._sends().cancel(request_id, reason)

    def _sends(self) -> RankSends:
        if self.sends is None:
            raise RuntimeError(f"tensor-parallel rank {self.rank} sends no KV")
        return self.sends

    def _receiver(self) -> HandoffReceiver:
        if self.receiver is None:
            raise RuntimeError(f"tensor-parallel rank {self.rank} receives no KV")
        return self.receiver

    def _send_layer(self, layer: int, plan: StepPlan) -> None:
        assert self.sends is not None
        self.sends.on_layer(layer, plan.attachments)

    def _run(self) -> None:
        error = ""
        try:
            self.shard.run(None if self.sends is None else self._send_layer)
        except BaseException as exc:  # noqa: BLE001 - reported through wait_stopped
            logger.exception("tensor-parallel rank %d stopped", self.rank)
            error = f"{type(exc).__name__}: {exc}"
        finally:
            self.group.close()
            self._stopped.set_result(error)
