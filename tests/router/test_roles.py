"""The role monitor without Ray: Serve's replica counts, each replica's load as it reported it
to Serve, and a replica reported dead that counts as missing until a probe sent after that
is answered."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from pdserve.replica import PrefillQueue, WorkerLoad
from pdserve.router.roles import RoleMonitor, replica_died, serve_routing_stats

LOAD = WorkerLoad(num_blocks=10, num_free_blocks=4, num_running=2, num_waiting=1)


class _Probe:
    def __init__(self, role: _Role) -> None:
        self.role = role

    async def remote(self) -> None:
        if not self.role.alive:
            await asyncio.sleep(30)  # Serve holds a call while the role has no replica
        self.role.probes += 1


class _Role:
    """A role's handle: ``check_health`` answers while alive; ``reports`` are its replicas'
    routing stats as Serve last delivered them."""

    def __init__(self, name: str) -> None:
        self.name, self.alive, self.probes = name, True, 0
        self.reports: list[tuple[str, Mapping[str, Any]]] = [(f"{name}-0", LOAD.to_stats())]
        self.check_health = _Probe(self)


def _stats(handle: _Role) -> list[tuple[str, Mapping[str, Any]]]:
    return handle.reports


def test_counts_loads_and_a_reported_death() -> None:
    async def run() -> None:
        prefill, decode = _Role("prefill"), _Role("decode")
        counts = {"prefill": 1, "decode": 1}

        async def source() -> dict[str, int]:
            return dict(counts)

        monitor = RoleMonitor({"prefill": prefill, "decode": decode}, source,
                              probe_timeout_s=0.2, routing_stats=_stats)
        assert monitor.missing() == []  # nothing known yet: nothing refused
        await monitor.poll()
        assert monitor.missing() == [] and prefill.probes == 0  # no probe while alive
        assert {(load.role, load.replica_id, load.kv_usage) for load in monitor.loads()} == {
            ("prefill", "prefill-0", 0.6), ("decode", "decode-0", 0.6)}

        decode.reports.append(("decode-1", {}))  # started, not reported yet: left out
        await monitor.poll()
        assert len(monitor.loads()) == 2

        prefill.alive = False
        monitor.report_dead("prefill")
        assert monitor.missing() == ["prefill"] and monitor.gone("prefill").is_set()
        await monitor.poll()  # Serve still counts the dead replica; its probe times out
        assert monitor.missing() == ["prefill"]

        prefill.alive = True
        await monitor.poll()  # the replacement answers a probe sent after the report
        assert monitor.missing() == [] and not monitor.gone("prefill").is_set()

        counts["decode"] = 0
        await monitor.poll()
        assert monitor.missing() == ["decode"]
        assert {load.role for load in monitor.loads()} == {"prefill"}

    asyncio.run(run())


def test_one_of_several_replicas_dying_leaves_the_role_present() -> None:
    async def run() -> None:
        async def source() -> dict[str, int]:
            return {"prefill": 2}

        monitor = RoleMonitor({"prefill": _Role("prefill")}, source, routing_stats=_stats)
        await monitor.poll()
        monitor.report_dead("prefill")
        assert monitor.missing() == []

    asyncio.run(run())


def test_loads_unreadable_from_serve_leave_the_roles_known() -> None:
    def unreadable(handle: Any) -> list[tuple[str, Mapping[str, Any]]]:
        raise LookupError("no stats here")

    async def run() -> None:
        async def source() -> dict[str, int]:
            return {"decode": 1}

        monitor = RoleMonitor({"decode": _Role("decode")}, source, routing_stats=unreadable)
        await monitor.poll()
        assert monitor.loads() == [] and monitor.missing() == []

    asyncio.run(run())


def test_a_handle_that_made_no_call_yet_is_started_and_shows_no_loads() -> None:
    class Fresh:
        is_initialized = False

        def options(self) -> None:
            self.is_initialized = True

    handle = Fresh()
    assert serve_routing_stats(handle) == [] and handle.is_initialized


def test_replica_death_is_told_apart_from_other_failures() -> None:
    class ActorDiedError(RuntimeError):
        pass

    assert replica_died(ActorDiedError("gone"))
    assert not replica_died(ValueError("bad input"))


def test_loads_are_known_once_every_role_reported() -> None:
    async def run() -> None:
        prefill, decode = _Role("prefill"), _Role("decode")
        prefill.reports, counts = [], {"prefill": 0, "decode": 1}

        async def source() -> dict[str, int]:
            return dict(counts)

        monitor = RoleMonitor({"prefill": prefill, "decode": decode}, source,
                              routing_stats=_stats)
        await monitor.poll()  # decode reported; prefill has no replica (yet)
        assert monitor.refreshed.is_set() and not monitor.loads_known.is_set()
        counts["prefill"] = 1
        await monitor.poll()  # its replica runs but has not reported yet
        assert not monitor.loads_known.is_set()
        prefill.reports = [("prefill-0", LOAD.to_stats())]
        await monitor.poll()
        assert monitor.loads_known.is_set()

    asyncio.run(run())


def test_a_queue_an_answer_carries_replaces_an_older_report_until_a_newer_one() -> None:
    async def run() -> None:
        prefill = _Role("prefill")
        # Reported while a 512-token prompt waited there (its 7th queue change).
        reported = replace(LOAD, num_queued_tokens=512, queue_seq=7)
        prefill.reports = [("prefill-0", reported.to_stats())]

        async def source() -> dict[str, int]:
            return {"prefill": 1}

        monitor = RoleMonitor({"prefill": prefill}, source, routing_stats=_stats)
        await monitor.poll()
        assert [load.num_queued_tokens for load in monitor.loads()] == [512]

        monitor.observe_queue("prefill-0", PrefillQueue(seq=6, num_tokens=0))  # older
        assert [load.num_queued_tokens for load in monitor.loads()] == [512]
        monitor.observe_queue("prefill-0", PrefillQueue(seq=8, num_tokens=0))  # it finished
        assert [(load.num_queued_tokens, load.queue_seq) for load in monitor.loads()] == [
            (0, 8)]
        await monitor.poll()  # the next report is still the old one: the answer stands
        assert [load.num_queued_tokens for load in monitor.loads()] == [0]

        prefill.reports = [("prefill-0", replace(LOAD, num_queued_tokens=90,
                                                 queue_seq=9).to_stats())]
        await monitor.poll()  # a report newer than the answer wins
        assert [load.num_queued_tokens for load in monitor.loads()] == [90]

        prefill.reports = []
        await monitor.poll()
        monitor.observe_queue("prefill-1", PrefillQueue(seq=1, num_tokens=5))
        assert monitor.loads() == []  # answers never invent a replica

    asyncio.run(run())


def test_a_prefill_queue_counts_its_changes() -> None:
    queue = PrefillQueue().add(300).add(20).add(-300)
    assert (queue.seq, queue.num_tokens) == (3, 20)
