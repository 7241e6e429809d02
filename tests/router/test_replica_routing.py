"""The roles' request routers, without Ray: a call that pins a replica (a prefix pull asking
the worker that caches it) goes to that replica alone while it runs; otherwise each policy
chooses as ever."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from pdserve.router.replica_routing import KVHeadroomRouter, RankedRouter, RoundRobinRouter


@dataclass(frozen=True)
class Pinned:
    pinned_replica: str


@dataclass(frozen=True)
class ReplicaID:
    unique_id: str


def replica(rid: str) -> Any:
    return SimpleNamespace(replica_id=ReplicaID(rid), routing_stats={})


def choose(router_class: type, replicas: list[Any], arg: Any) -> list[list[str]]:
    router = object.__new__(router_class)
    router.initialize_state()
    ranks = asyncio.run(router.choose_replicas(replicas, SimpleNamespace(args=[arg])))
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


def test_every_policy_sends_a_pinned_call_to_its_replica_while_it_runs() -> None:
    replicas = [replica("a"), replica("b"), replica("c")]
    for router_class in (RankedRouter, RoundRobinRouter, KVHeadroomRouter):
        assert choose(router_class, replicas, Pinned("b")) == [["b"]], router_class
        # The pinned replica is gone: the policy chooses (the worker there refuses the call).
        gone = choose(router_class, replicas, Pinned("z"))
        assert sorted(r for rank in gone for r in rank) == ["a", "b", "c"], router_class
    ranked = choose(RankedRouter, replicas, SimpleNamespace(replica_ranking=("c", "a")))
    assert ranked == [["c"], ["a"], ["b"]]
