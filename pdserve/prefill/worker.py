"""The prefill worker: computes a prompt's KV, streams it layer by layer to a decode worker.

Returns the first token at once; the request's blocks stay pinned until the sends complete.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import asdict
from typing import Any

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.engine import LLMEngine, RequestOutput
from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.request import RequestMode, RequestStatus
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.handoff.config import HandoffConfig
from pdserve.handoff.sender import HandoffSender, OutboundTransfer
from pdserve.handoff.ticket import HandoffTicket, SendResult
from pdserve.prefill.api import PrefillRequest, PrefillResult

logger = logging.getLogger(__name__)


class PrefillWorker:
    """One prefill replica: an engine in prefill-only mode plus a handoff sender.

    Block lifetime on this side (deferred free): a request's blocks are pinned from its
    first chunk until the sender reports every send of its transfer completed or aborted;
    only then does the engine release them (full blocks stay in the prefix cache).
    """

    def __init__(self, engine_config: EngineConfig, handoff_config: HandoffConfig) -> None:
        self.engine = LLMEngine(engine_config)
        self.sender = HandoffSender(self.engine.kv_cache, self.engine.layout, handoff_config)
        # Touched only on the engine thread (commands and the layer hook run there).
        self._transfers: dict[str, OutboundTransfer] = {}
        self.async_engine = AsyncEngine(self.engine, layer_hook=self._send_layer)
        self.num_transfers_failed = 0
        logger.info("prefill worker ready: %d KV blocks of %d tokens",
                    self.engine.kv_manager.num_blocks, self.engine.layout.block_size)

    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        rid = request.request_id
        ticket = HandoffTicket.from_dict(request.ticket)
        self.engine.layout.check_matches(ticket.layout)
        transfer = self.sender.open(ticket)
        arrived = time.monotonic()
        await self.async_engine.call(lambda: self._transfers.__setitem__(rid, transfer))
        first: RequestOutput | None = None
        stream = self.async_engine.open_stream(rid)
        try:
            await self.async_engine.call(lambda: self.engine.add_request(
                rid, request.prompt_token_ids, request.sampling_params, RequestMode.PREFILL_ONLY))
            async for out in self.async_engine.stream(rid, stream):
                first = out
        except BaseException:
            # Cancelled or failed before the first token: abort the sends, free on completion.
            transfer.abort("prefill did not finish")
            self._release_when_sent(rid, transfer)
            raise
        finally:
            await self.async_engine.close_stream(rid, abort=False)
        assert first is not None and first.new_token_ids
        transfer.send_fence(first.new_token_ids[0])
        self._release_when_sent(rid, transfer)
        done = time.monotonic()
        return PrefillResult(
            request_id=rid, first_token_id=first.new_token_ids[0], first_text=first.new_text,
            num_cached_tokens=first.num_cached_tokens,
            num_computed_tokens=first.num_prompt_tokens - first.num_cached_tokens,
            queue_s=first.queue_s, compute_s=max(0.0, done - arrived - first.queue_s),
        )

    def _send_layer(self, layer: int, output: SchedulerOutput) -> None:
        """Engine thread, right after `layer` wrote its KV: ship it for finished prompts."""
        block_size = self.engine.layout.block_size
        for chunk in output.chunks:
            transfer = self._transfers.get(chunk.request.request_id)
            if transfer is None or not chunk.samples:
                continue  # not a handoff request, or its prompt is not complete yet
            num_blocks = -(-chunk.request.num_prompt_tokens // block_size)
            block_ids = self.engine.kv_manager.block_ids(chunk.request.request_id)[:num_blocks]
            transfer.send_layer(layer, block_ids)

    def _release_when_sent(self, request_id: str, transfer: OutboundTransfer) -> None:
        def release(done: Future[SendResult]) -> None:
            result = done.result()
            if not result.ok:
                self.num_transfers_failed += 1
                logger.warning("handoff of %s failed: %s", request_id, result.error)
            self.async_engine.submit(lambda: self._forget(request_id))

        transfer.result.add_done_callback(release)

    def _forget(self, request_id: str) -> None:
        """Engine thread: the transfer is over, so the request's blocks may go."""
        self._transfers.pop(request_id, None)
        request = self.engine.scheduler.get_request(request_id)
        if request is not None and request.status is RequestStatus.PREFILLED:
            self.engine.release(request_id)  # full blocks stay in the prefix cache
        else:
            self.engine.abort(request_id)  # cancelled before its prompt was done

    async def kv_stats(self) -> dict[str, Any]:
        return asdict(await self.async_engine.call(self.engine.kv_stats))

    def record_routing_stats(self) -> dict[str, Any]:
        kv = self.engine.kv_manager
        return {"num_free_blocks": kv.num_free_blocks, "num_blocks": kv.num_blocks,
                "num_waiting": self.engine.scheduler.num_waiting}

    def check_health(self) -> None:
        if self.async_engine.is_dead:
            raise RuntimeError("prefill engine thread died")

    def __del__(self) -> None:
        self.async_engine.shutdown()
        self.sender.close()
