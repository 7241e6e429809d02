"""The roles' request routers, without Ray: a call that pins a replica (a prefix pull asking
the worker that caches it) goes to that replica alone while it runs; otherwise each policy
chooses as ever, and replicas a policy ranks alike are split by the requests in flight."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from pdserve.router.replica_routing import (
    RESERVATION_S,
    InFlight,
    KVHeadroomRouter,
    RankedRouter,
    RoundRobinRouter,
)


@dataclass(frozen=True)
class Pinned:
    pinned_replica: str


@dataclass(frozen=True)
class ReplicaID:
    unique_id: str


def replica(rid: str) -> Any:
    return SimpleNamespace(replica_id=ReplicaID(rid), routing_stats={})


def new_router(router_class: type) -> Any:
    """A router as Serve's handle makes one, less Serve's own state (its queue-length cache
    is off, as it is in pdserve's deployments)."""
    router = object.__new__(router_class)
    router._use_replica_queue_len_cache = False
    router.initialize_state()
    return router


def choose(router_class: type | Any, replicas: list[Any], arg: Any) -> list[list[str]]:
    router = new_router(router_class) if isinstance(router_class, type) else router_class
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


def test_a_burst_of_choices_spreads_over_replicas_ranked_alike() -> None:
    # Equal KV headroom: one rank for all three. Serve would pick within it by probed queue
    # lengths that a burst's choices all share; the router spreads the burst itself.
    replicas = [replica("a"), replica("b"), replica("c")]
    router = new_router(KVHeadroomRouter)
    firsts = [choose(router, replicas, None)[0][0] for _ in range(6)]
    assert sorted(firsts) == ["a", "a", "b", "b", "c", "c"]
    assert all(len(rank) == 1 for rank in choose(router, replicas, None))


def test_sends_and_completions_steer_the_next_choice() -> None:
    replicas = [replica("a"), replica("b")]
    router = new_router(KVHeadroomRouter)
    a, b = (r.replica_id for r in replicas)
    for _ in range(3):
        router.on_send_request(a)  # sent without a choice of this router (e.g. a retry)
    router.on_send_request(b)
    assert choose(router, replicas, None)[0] == ["b"]
    router.on_send_request(b)  # the send of that choice: counted once, not twice
    for _ in range(3):
        router.on_request_completed(a, "done")
    assert choose(router, replicas, None)[0] == ["a"]


def test_a_choice_never_sent_stops_counting_and_a_gone_replica_is_forgotten() -> None:
    now = [0.0]
    tally = InFlight(clock=lambda: now[0])
    tally.reserve("a")
    tally.sent("b")
    assert (tally.count("a"), tally.count("b")) == (1, 1)
    now[0] += RESERVATION_S
    assert (tally.count("a"), tally.count("b")) == (0, 1)
    tally.completed("b")
    tally.completed("b")  # a completion the tally never saw sent does not go below zero
    assert tally.count("b") == 0
    tally.sent("c")
    tally.keep_only({"a", "b"})
    assert tally.count("c") == 0
