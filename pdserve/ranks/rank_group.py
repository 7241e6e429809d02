"""Rank 0's side of a replica's ranks: it starts ranks 1..N-1 as Ray actors in the replica's
placement group (bundle i for rank i), builds its own engine with them, and watches them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.parallel.group import (
    Rendezvous,
    TPGroup,
    connect_group,
    host_store,
)
from pdserve.engine.replica_ranks import ONE_RANK, ReplicaRanks
from pdserve.handoff import FenceInfo, HandoffConfig
from pdserve.ranks.rank_actor import TPRank

logger = logging.getLogger(__name__)
T = TypeVar("T")

# How often start-up looks for a rank that failed to start while rank 0 waits for it in the
# group's rendezvous (which would otherwise wait for it as long as its store allows).
_START_POLL_S = 0.2


class RankStoppedError(RuntimeError):
    """A rank other than 0 died or left its step loop: the replica cannot step any more."""


@dataclass(frozen=True)
class RankSettings:
    """A role's ranks per replica, the bound on each collective of the model (a dead or stuck
    rank fails the others within it), and what Ray gives each rank actor. A `RankStarter`:
    the cluster hands it to the role's workers."""

    size: int
    collective_timeout_s: float
    role: str
    actor_options: dict[str, Any] = field(default_factory=dict)
    # Each rank receives (decode) or sends (prefill) the KV heads it holds over its own link.
    handoff: HandoffConfig | None = None

    def start(self, config: EngineConfig,
              build: Callable[[TPGroup], T]) -> tuple[ReplicaRanks, T]:
        return start_ranks(self, config, build)


class RankGroup:
    """The ranks of one replica as rank 0 holds them: the collective group its engine uses
    (`tp`), and the other ranks' actors."""

    def __init__(self, tp: TPGroup, actors: list[Any], watches: list[Any]) -> None:
        self.tp = tp
        self._actors = actors
        self._watches = watches  # each rank's pending `wait_stopped`, in rank order

    @property
    def size(self) -> int:
        return self.tp.size

    def check(self) -> None:
        """Raise `RankStoppedError` when a rank died or left its loop (never blocks)."""
        if not self._watches:
            return
        done, _ = ray.wait(self._watches, num_returns=len(self._watches), timeout=0)
        for ref in done:
            rank = self._watches.index(ref) + 1
            try:
                reason = ray.get(ref) or "it was told to stop"
            except ray.exceptions.RayError as exc:
                reason = f"its actor died ({type(exc).__name__})"
            raise RankStoppedError(f"tensor-parallel rank {rank} of {self.size} stopped: "
                                   f"{reason}")

    def receiver(self, rank: int) -> RemoteReceiver:
        """Rank ``rank``'s KV receiver (a `handoff.RankReceiver`), through its actor."""
        return RemoteReceiver(self._actors[rank - 1])

    def sends(self, rank: int) -> RemoteSends:
        """Rank ``rank``'s KV sends (a `prefill.worker.RankSends`), through its actor."""
        return RemoteSends(self._actors[rank - 1])

    def close(self) -> None:
        """End the other ranks and let go of the group (call after rank 0's engine stopped)."""
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        self._actors.clear()
        self._watches.clear()
        self.tp.close()


class RemoteReceiver:
    """A rank actor's KV receiver, called from rank 0's event loop."""

    def __init__(self, actor: Any) -> None:
        self._actor = actor

    async def reserve(self, request_id: str, block_ids: Sequence[int], num_tokens: int,
                      deadline: float, kv_heads: tuple[int, int]) -> dict[str, Any]:
        return await self._actor.reserve.remote(request_id, list(block_ids), num_tokens,
                                                deadline, kv_heads)

    async def wait_ready(self, request_id: str) -> FenceInfo:
        return await self._actor.wait_ready.remote(request_id)

    async def cancel(self, request_id: str) -> bool:
        return await self._actor.cancel.remote(request_id)


class RemoteSends:
    """A prefill rank actor's KV sends, asked from rank 0's threads."""

    def __init__(self, actor: Any) -> None:
        self._actor = actor

    def released(self, request_id: str) -> Future[Any]:
        """Resolves once the rank's sends of ``request_id`` no longer read its blocks (fails
        when the actor died: then nothing of it reads them either)."""
        return self._actor.wait_released.remote(request_id).future()  # type: ignore[no-any-return]

    def cancel(self, request_id: str, reason: str) -> None:
        self._actor.cancel_sends.remote(request_id, reason)


def start_ranks(settings: RankSettings, config: EngineConfig,
                build: Callable[[TPGroup], T]) -> tuple[ReplicaRanks, T]:
    """Start the replica's other ranks and ``build(tp)`` rank 0's engine with them (one
    rank: just ``build``). A rank that fails to start fails this with its error."""
    if settings.size == 1:
        return ONE_RANK.start(config, build)
    timeout_s = settings.collective_timeout_s
    rendezvous, store = host_store(ray.util.get_node_ip_address(), settings.size, timeout_s)
    actors = [_launch(settings, config, rendezvous, rank) for rank in range(1, settings.size)]
    built: Future[tuple[TPGroup, T]] = Future()

    def rank_zero() -> None:
        try:
            tp = connect_group(rendezvous, 0, config.resolve_device(), timeout_s, store)
            built.set_result((tp, build(tp)))
        except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread
            built.set_exception(exc)

    threading.Thread(target=rank_zero, name="pdserve-rank-0-start", daemon=True).start()
    try:
        _wait_started(actors, built)
        tp, engine = built.result()
    except BaseException:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        raise
    ranks = RankGroup(tp, actors, [actor.wait_stopped.remote() for actor in actors])
    logger.info("%s replica: %d tensor-parallel ranks started", settings.role, settings.size)
    return ranks, engine


def _launch(settings: RankSettings, config: EngineConfig, rendezvous: Rendezvous,
            rank: int) -> Any:
    options: dict[str, Any] = dict(settings.actor_options)
    group = get_current_placement_group()
    if group is not None:  # a Serve replica with bundles: rank i runs in bundle i
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=rank,
            placement_group_capture_child_tasks=True)
    return ray.remote(TPRank).options(**options).remote(
        config, rendezvous, rank, settings.collective_timeout_s, settings.role, settings.handoff)


def _wait_started(actors: list[Any], built: Future[Any]) -> None:
    """Until rank 0's engine is built and every rank answered; a rank that failed to start
    raises at once (rank 0 would otherwise wait for it in the rendezvous)."""
    pending = [actor.describe.remote() for actor in actors]
    while pending or not built.done():
        if pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=_START_POLL_S)
            ray.get(done)  # raises the error of a rank that failed to start
        else:
            built.exception(timeout=None)
        if built.done() and built.exception() is not None:
            return
