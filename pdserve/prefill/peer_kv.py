"""Prefix pulls between prefill workers: the puller reserves device blocks and asks the worker
that caches the prefix (a Serve call pinned to its replica) to send them over the handoff.

The KV itself moves only on the handoff's data plane (authenticated, digest-fenced).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.engine.engine import LLMEngine
from pdserve.engine.tiers.peer import PeerTier
from pdserve.handoff import (
    FenceInfo,
    HandoffError,
    HandoffReceiver,
    HandoffTransport,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerSendRequest:
    """A puller's ask: send blocks ``[first_block, len(token_ids) // block_size)`` of this
    token sequence from the prefix cache into the ticket's blocks. ``pinned_replica``: the
    replica whose cache holds them (the role's request router sends the call there)."""

    pull_id: str
    ticket: dict[str, Any]
    token_ids: list[int]
    first_block: int
    pinned_replica: str


@dataclass(frozen=True)
class PeerSource:
    """Which replica caches how many of a prompt's leading blocks."""

    replica_id: str
    num_blocks: int


def best_source(candidates: tuple[tuple[str, int], ...], own_id: str) -> PeerSource | None:
    """The replica other than ``own_id`` that caches the most blocks (None: no other)."""
    others = [PeerSource(rid, n) for rid, n in candidates if rid != own_id and n > 0]
    return max(others, key=lambda s: s.num_blocks, default=None)


def failure_reason(exc: HandoffError) -> str:
    return exc.code if exc.code.isidentifier() else "handoff"


class PeerPuller:
    """The pulling side, on one prefill worker: a receiver into its own KV cache.

    Block lifetime: the engine owns the request's device blocks from the load's start; the
    receiver writes into them until the fence verified, the transfer failed or `cancel`
    returned; only then does the pull report its end (`PeerTier.finish`), after which the
    engine uses or frees them.
    """

    def __init__(self, transport: HandoffTransport, engine: LLMEngine,
                 source_handle: Callable[[], Any]) -> None:
        """``source_handle``: the prefill role's Serve handle (made on first use)."""
        self.receiver = HandoffReceiver(transport, engine.kv_cache, engine.layout)
        self._layout = engine.layout
        self._source_handle = source_handle
        self._sources: dict[str, str] = {}  # request id -> replica asked (engine thread)
        self.loop: asyncio.AbstractEventLoop | None = None  # the replica's, set per call
        cfg = engine.config
        engine.tiers.attach_peer(self._start, cfg.peer_link_latency_s, cfg.peer_link_bytes_per_s)
        assert engine.tiers.peer is not None
        self._peer: PeerTier = engine.tiers.peer

    def hint(self, request_id: str, source: PeerSource) -> None:
        """Engine thread, before the request is added: ``source`` caches a longer prefix."""
        self._sources[request_id] = source.replica_id
        self._peer.hint(request_id, source.num_blocks)

    def forget(self, request_id: str) -> None:
        """Engine thread: the request ended; a pull still writing for it is cancelled (its
        end then frees the blocks)."""
        self._sources.pop(request_id, None)
        self._peer.forget(request_id)
        self.receiver.cancel(_pull_id(request_id))

    def _start(self, request_id: str, token_ids: list[int], first_block: int,
               device_ids: list[int]) -> None:
        """Engine thread (`PeerPull`): reserve the blocks, then ask the source."""
        started = time.monotonic()
        source = self._sources.get(request_id)
        pull_id = _pull_id(request_id)
        if source is None or self.loop is None:
            self._peer.finish(request_id, "no_source", 0, 0.0)
            return
        try:
            ticket = self.receiver.reserve(pull_id, device_ids, self._layout,
                                           len(device_ids) * self._layout.block_size)
        except ValueError as exc:
            logger.warning("peer pull for %s not reserved: %s", request_id, exc)
            self._peer.finish(request_id, "reserve", 0, 0.0)
            return
        ask = PeerSendRequest(pull_id, ticket.to_dict(), token_ids, first_block, source)
        pull = self._pull(request_id, ask, started)
        try:
            asyncio.run_coroutine_threadsafe(pull, self.loop)
        except RuntimeError:  # the replica's loop is closed: it is stopping
            pull.close()
            self.receiver.cancel(pull_id)
            self._peer.finish(request_id, "stopping", 0, 0.0)

    async def _pull(self, request_id: str, ask: PeerSendRequest, started: float) -> None:
        """The replica's loop: wait for the fence or the source's refusal; exactly one end."""
        error: str | None = None
        num_bytes = 0
        try:
            fence = await self._await_fence(ask)
            num_bytes = fence.num_bytes
        except _PullFailed as failed:
            error = failed.reason
        except Exception as exc:  # noqa: BLE001 - whatever broke, the prefix is computed
            logger.warning("peer pull for %s failed: %r", request_id, exc)
            self.receiver.cancel(ask.pull_id)
            error = "pull_error"
        if error is not None:
            logger.info("peer pull for %s from %s failed (%s): computing the prefix",
                        request_id, ask.pinned_replica, error)
        self._peer.finish(request_id, error, num_bytes, time.monotonic() - started)

    async def _await_fence(self, ask: PeerSendRequest) -> FenceInfo:
        ready = asyncio.wrap_future(self.receiver.ready_future(ask.pull_id))
        answer = asyncio.ensure_future(_answer(self._source_handle().send_cached.remote(ask)))
        done, _ = await asyncio.wait({ready, answer}, return_when=asyncio.FIRST_COMPLETED)
        refusal = None
        if ready not in done:
            refusal = answer.result()
            if refusal is not None:  # the source sends nothing (more): stop waiting for it
                self.receiver.cancel(ask.pull_id)
            await asyncio.wait({ready})
        try:
            return ready.result()
        except HandoffError as exc:
            raise _PullFailed(refusal or failure_reason(exc)) from exc


async def _answer(call: Any) -> str | None:
    """The source's answer: None (sent), a refusal reason, or peer_gone when the call failed
    (the replica died, or Serve could not reach it)."""
    try:
        return await call  # type: ignore[no-any-return]
    except Exception as exc:  # noqa: BLE001 - any failure of the call means no KV comes
        logger.warning("peer send call failed: %r", exc)
        return "peer_gone"


def _pull_id(request_id: str) -> str:
    return f"{request_id}/peer"


class _PullFailed(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
