"""What the ingress knows of the worker roles: which have a live replica, and each replica's
KV use and queues, refreshed in the background for /health, /metrics and path choice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from pdserve.replica import PrefillQueue, WorkerLoad
from pdserve.router.background import BackgroundTask

logger = logging.getLogger(__name__)

# Running replicas of each role, e.g. {"decode": 1, "prefill": 0}.
ReplicaCounts = Mapping[str, int]
# A role's replicas' latest reports: (replica id, routing stats) each.
RoutingStats = Callable[[Any], list[tuple[str, Mapping[str, Any]]]]


@dataclass(frozen=True, kw_only=True)
class ReplicaLoad(WorkerLoad):
    """One replica's load as it last reported it, labelled with its role and replica id."""

    role: str
    replica_id: str


class RoleMonitor:
    """Polls every ``interval_s``: Serve's count of running replicas per role (`counts`), and
    each running replica's load as it last reported it to Serve (``routing_stats``, read
    from the role's handle: the same record the role's request router ranks replicas on).

    Serve's controller notices a replica that died only at its next health check; a call
    that failed because its replica died says so at once (`report_dead`): the role then
    counts as missing until a probe (``check_health`` through its handle) sent after that
    gets an answer.
    """

    def __init__(self, handles: Mapping[str, Any], counts: Callable[[], Awaitable[ReplicaCounts]],
                 interval_s: float = 1.0, probe_timeout_s: float = 2.0,
                 routing_stats: RoutingStats | None = None,
                 on_loads: Callable[[list[ReplicaLoad]], None] | None = None) -> None:
        self.handles = dict(handles)
        self._counts_source = counts
        self._routing_stats = routing_stats or serve_routing_stats
        self._on_loads = on_loads  # told every poll's loads (the prefix index follows them)
        self.interval_s = interval_s
        self.probe_timeout_s = probe_timeout_s
        self.counts: dict[str, int] | None = None  # None until the first poll answered
        self._loads: list[ReplicaLoad] = []
        self._background = BackgroundTask(self._run)
        self.refreshed = asyncio.Event()
        self.loads_known = asyncio.Event()  # set once every role reported a replica's load
        self._dead_since: dict[str, float] = {}
        self._gone = {role: asyncio.Event() for role in self.handles}
        self._unreadable: set[str] = set()  # roles whose loads Serve's handle does not show
        self._queues: dict[str, PrefillQueue] = {}  # fresher than the reports, by replica

    def start(self) -> None:
        """Start polling on the running loop (idempotent)."""
        self._background.start()

    async def stop(self) -> None:
        await self._background.stop()

    def missing(self) -> list[str]:
        """Roles with no running replica, or whose replica was just reported dead."""
        counted = set() if self.counts is None else {
            role for role in self.handles if self.counts.get(role, 0) == 0}
        return sorted(counted | set(self._dead_since))

    def report_dead(self, role: str) -> None:
        """A call to ``role`` failed because its replica died: if that was the role's only
        replica as far as Serve last said, the role is missing now."""
        if self.counts is not None and self.counts.get(role, 0) > 1:
            return  # others serve on; Serve's router already avoids the dead one
        if role in self.handles and role not in self._dead_since:
            logger.warning("a %s replica died; the role counts as missing until one answers",
                           role)
            self._dead_since[role] = time.monotonic()
            self._gone[role].set()

    def gone(self, role: str) -> asyncio.Event:
        """Set while ``role`` is reported dead: calls waiting on it may give up."""
        return self._gone[role]

    def loads(self) -> list[ReplicaLoad]:
        """Every running replica's load, as of the last poll; a prefill queue seen newer
        since (`observe_queue`) replaces the reported one."""
        return [self._fresher(load) for load in self._loads]

    def observe_queue(self, replica_id: str, queue: PrefillQueue) -> None:
        """A prefill replica's queue as one of its answers carried it. Its load reports lag
        up to a report period: without this, a report taken while a prompt was queued
        there would price that replica a whole prompt dearer after the prompt was done (and
        send the next repeat of a cached prefix elsewhere)."""
        known = self._queues.get(replica_id)
        if known is None or queue.seq > known.seq:
            self._queues[replica_id] = queue

    def _fresher(self, load: ReplicaLoad) -> ReplicaLoad:
        queue = self._queues.get(load.replica_id)
        if queue is None or queue.seq <= load.queue_seq:
            return load
        return replace(load, num_queued_tokens=queue.num_tokens, queue_seq=queue.seq)

    async def _run(self) -> None:
        while True:
            try:
                await self.poll()
            except Exception:  # noqa: BLE001 - keep polling; the next round may work
                logger.warning("polling the worker roles failed", exc_info=True)
            await asyncio.sleep(self.interval_s)

    async def poll(self) -> None:
        counts = dict(await self._counts_source())
        await asyncio.gather(*(self._probe(role) for role in list(self._dead_since)))
        self.counts = counts
        self._loads = [load for role in self.handles if counts.get(role)
                       for load in self._reported(role)]
        running = {load.replica_id for load in self._loads}
        self._queues = {rid: q for rid, q in self._queues.items() if rid in running}
        if self._on_loads is not None:
            self._on_loads(self._loads)
        self.refreshed.set()
        if {load.role for load in self._loads} | self._unreadable >= set(self.handles):
            self.loads_known.set()

    def _reported(self, role: str) -> list[ReplicaLoad]:
        try:
            reports = self._routing_stats(self.handles[role])
        except LookupError as exc:
            if role not in self._unreadable:
                self._unreadable.add(role)
                logger.warning("%s: the %s replicas' loads stay unknown (no per-replica "
                               "metrics; prefill queues counted from this ingress only)",
                               exc, role)
            return []
        return [ReplicaLoad(role=role, replica_id=replica, **load.to_stats())
                for replica, stats in reports
                if (load := WorkerLoad.from_stats(stats)) is not None]

    async def _probe(self, role: str) -> None:
        sent_at = time.monotonic()
        try:
            async with asyncio.timeout(self.probe_timeout_s):
                await self.handles[role].check_health.remote()
        except Exception:  # noqa: BLE001 - a slow or dying replica just misses this round
            return
        if self._dead_since.get(role, sent_at) < sent_at:  # a live replica answered
            del self._dead_since[role]
            self._gone[role].clear()


def serve_routing_stats(handle: Any) -> list[tuple[str, Mapping[str, Any]]]:
    """(replica id, latest `record_routing_stats` answer) of each running replica, as Serve's
    controller delivered them to this handle's router; replicas that have not reported yet
    are left out. A handle that made no call yet gets its router started here (empty until
    Serve's first update reaches it).

    Serve (2.60) has no public call for these: its handle's router keeps the running
    replicas with their stats, and this reads them where it keeps them.
    """
    if not getattr(handle, "is_initialized", True):
        handle.options()  # Serve starts a handle's router on its first options() or call
        return []
    router = getattr(getattr(handle, "_router", None), "_asyncio_router", None)
    if router is None:
        raise LookupError("this Ray Serve keeps its replicas' routing stats elsewhere")
    request_router = getattr(router, "_request_router", None)
    if request_router is not None:
        replicas = [(r.replica_id, r.routing_stats)
                    for r in list(request_router.curr_replicas.values())]
    else:  # Serve hands the replicas to the request router when it first routes
        replicas = [(info.replica_id, info.routing_stats)
                    for info in list(getattr(router, "_running_replicas", None) or [])]
    return [(str(replica.unique_id), dict(stats or {})) for replica, stats in replicas]


async def serve_replica_counts(app_name: str, handles: Mapping[str, Any]) -> dict[str, int]:
    """Running replicas of each role of ``app_name``: what each role's handle's router holds
    (Serve's controller keeps it current); only when a role looks empty is the controller
    asked itself (`serve.status`, which serializes every deployment's config: ~10 ms of the
    ingress's CPU per call, too much to spend every second)."""
    from ray import serve

    counts: dict[str, int] = {}
    for role, handle in handles.items():
        try:
            counts[role] = len(serve_routing_stats(handle))
        except LookupError:
            counts[role] = 0
    if all(counts.values()):
        return counts
    details = await asyncio.to_thread(serve.status)
    app = details.applications.get(app_name)
    if app is None:
        return dict.fromkeys(handles, 0)
    return {role: (app.deployments[role].replica_states.get("RUNNING", 0)
                   if role in app.deployments else 0) for role in handles}


def replica_died(exc: BaseException) -> bool:
    """Whether a call failed because the replica serving it died (Ray's actor errors)."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & {"ActorDiedError", "RayActorError", "ActorUnavailableError"})
