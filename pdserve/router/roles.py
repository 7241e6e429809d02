"""What the ingress knows of the worker roles: which have a live replica, and each replica's
KV use and queues, refreshed in the background for /health, /metrics and path choice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

# Running replicas of each role, e.g. {"decode": 1, "prefill": 0}.
ReplicaCounts = Mapping[str, int]
# A replica's figures keep counting this long after its last report (it may not have been
# the one the router picked for the latest probes).
STATS_TTL_S = 10.0


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica's KV pool and queues, as it reported them (`role_stats`)."""

    role: str
    replica_id: str
    num_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    num_queued_tokens: int = 0  # prompt tokens not prefilled yet (prefill replicas)
    reported_at: float = field(default_factory=time.monotonic)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0


class RoleMonitor:
    """Polls every ``interval_s``: Serve's count of running replicas per role (`counts`), and
    each role's `role_stats` (through its handle, so the role's router picks a replica; with
    several replicas, as many probes as replicas, and each one's latest figures kept).

    Serve's controller notices a replica that died only at its next health check; a call
    that failed because its replica died says so at once (`report_dead`): the role then
    counts as missing until a probe sent after that gets an answer.
    """

    def __init__(self, handles: Mapping[str, Any], counts: Callable[[], Awaitable[ReplicaCounts]],
                 interval_s: float = 1.0, probe_timeout_s: float = 2.0) -> None:
        self.handles = dict(handles)
        self._counts_source = counts
        self.interval_s = interval_s
        self.probe_timeout_s = probe_timeout_s
        self.counts: dict[str, int] | None = None  # None until the first poll answered
        self._loads: dict[tuple[str, str], ReplicaLoad] = {}
        self._task: asyncio.Task[None] | None = None
        self.refreshed = asyncio.Event()
        self._dead_since: dict[str, float] = {}
        self._gone = {role: asyncio.Event() for role in self.handles}

    def start(self) -> None:
        """Start polling on the running loop (idempotent)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

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
        now = time.monotonic()
        return [load for load in self._loads.values() if now - load.reported_at < STATS_TTL_S]

    async def _run(self) -> None:
        while True:
            try:
                await self.poll()
            except Exception:  # noqa: BLE001 - keep polling; the next round may work
                logger.warning("polling the worker roles failed", exc_info=True)
            await asyncio.sleep(self.interval_s)

    async def poll(self) -> None:
        counts = dict(await self._counts_source())
        # A role reported dead is probed even where Serve still counts no replica for it.
        probes = [self._probe(role) for role, n in counts.items() if role in self.handles
                  for _ in range(max(n, role in self._dead_since))]
        await asyncio.gather(*probes)
        self.counts = counts
        alive = {role for role, n in counts.items() if n}
        self._loads = {key: load for key, load in self._loads.items() if key[0] in alive}
        self.refreshed.set()

    async def _probe(self, role: str) -> None:
        sent_at = time.monotonic()
        try:
            async with asyncio.timeout(self.probe_timeout_s):
                stats = await self.handles[role].role_stats.remote()
        except Exception:  # noqa: BLE001 - a slow or dying replica just misses this round
            return
        if self._dead_since.get(role, sent_at) < sent_at:  # a live replica answered
            del self._dead_since[role]
            self._gone[role].clear()
        load = ReplicaLoad(role=role, replica_id=str(stats["replica_id"]),
                           num_blocks=int(stats["num_blocks"]),
                           num_free_blocks=int(stats["num_free_blocks"]),
                           num_running=int(stats["num_running"]),
                           num_waiting=int(stats["num_waiting"]),
                           num_queued_tokens=int(stats.get("num_queued_tokens", 0)))
        self._loads[(role, load.replica_id)] = load


async def serve_replica_counts(app_name: str, roles: list[str]) -> dict[str, int]:
    """Running replicas of each role of ``app_name``, from Serve's controller."""
    from ray import serve

    details = await asyncio.to_thread(serve.status)
    app = details.applications.get(app_name)
    if app is None:
        return dict.fromkeys(roles, 0)
    return {role: (app.deployments[role].replica_states.get("RUNNING", 0)
                   if role in app.deployments else 0) for role in roles}


def replica_died(exc: BaseException) -> bool:
    """Whether a call failed because the replica serving it died (Ray's actor errors)."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & {"ActorDiedError", "RayActorError", "ActorUnavailableError"})
