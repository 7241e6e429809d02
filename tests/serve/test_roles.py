"""The role monitor without Ray: Serve's replica counts, probes through fake handles, and a
replica reported dead that counts as missing until a probe sent after that is answered."""

from __future__ import annotations

import asyncio

from pdserve.router.roles import RoleMonitor, replica_died


class _Method:
    def __init__(self, role: _Role) -> None:
        self.role = role

    async def remote(self) -> dict:
        if not self.role.alive:
            await asyncio.sleep(30)  # Serve holds a call while the role has no replica
        self.role.calls += 1
        return {"replica_id": f"{self.role.name}-{self.role.generation}", "num_blocks": 10,
                "num_free_blocks": 4, "num_running": 2, "num_waiting": 1}


class _Role:
    def __init__(self, name: str) -> None:
        self.name, self.alive, self.generation, self.calls = name, True, 0, 0
        self.role_stats = _Method(self)


def test_counts_probes_and_a_reported_death() -> None:
    async def run() -> None:
        prefill, decode = _Role("prefill"), _Role("decode")
        counts = {"prefill": 1, "decode": 1}

        async def source() -> dict[str, int]:
            return dict(counts)

        monitor = RoleMonitor({"prefill": prefill, "decode": decode}, source,
                              probe_timeout_s=0.2)
        assert monitor.missing() == []  # nothing known yet: nothing refused
        await monitor.poll()
        assert monitor.missing() == []
        assert {(load.role, load.kv_usage) for load in monitor.loads()} == {
            ("prefill", 0.6), ("decode", 0.6)}

        prefill.alive = False
        monitor.report_dead("prefill")
        assert monitor.missing() == ["prefill"] and monitor.gone("prefill").is_set()
        await monitor.poll()  # Serve still counts the dead replica; its probe times out
        assert monitor.missing() == ["prefill"]

        prefill.alive, prefill.generation = True, 1
        await monitor.poll()  # the replacement answers a probe sent after the report
        assert monitor.missing() == [] and not monitor.gone("prefill").is_set()

        counts["decode"] = 0
        await monitor.poll()
        assert monitor.missing() == ["decode"]

    asyncio.run(run())


def test_one_of_several_replicas_dying_leaves_the_role_present() -> None:
    async def run() -> None:
        async def source() -> dict[str, int]:
            return {"prefill": 2}

        monitor = RoleMonitor({"prefill": _Role("prefill")}, source)
        await monitor.poll()
        monitor.report_dead("prefill")
        assert monitor.missing() == []

    asyncio.run(run())


def test_replica_death_is_told_apart_from_other_failures() -> None:
    class ActorDiedError(RuntimeError):
        pass

    assert replica_died(ActorDiedError("gone"))
    assert not replica_died(ValueError("bad input"))
