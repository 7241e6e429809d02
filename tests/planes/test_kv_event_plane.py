"""The KV event plane over loopback, without Ray: an ingress's feed follows a worker's
event log from a snapshot on; a gap resyncs it; a worker that goes away drops its entries at
once; a peer without the cluster token learns nothing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from pdserve.engine.kv.events import KVEventLog, Tier
from pdserve.planes.kv_event_server import KVEventServer
from pdserve.planes.kv_event_wire import WorkerIdentity
from pdserve.router.kv_event_feed import KVEventFeed

TOKEN = "kv-events-test-token-0123456789"


def server(log: KVEventLog, token: str = TOKEN) -> KVEventServer:
    return KVEventServer(log, WorkerIdentity("w1", "layout", "salt", 16), token,
                         "127.0.0.1").start()


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def h(i: int) -> bytes:
    return bytes([i]) * 32


def test_a_feed_follows_snapshot_then_events_and_resyncs_on_a_gap() -> None:
    log = KVEventLog()
    log.stored(h(1), Tier.DEVICE)  # before anyone subscribes: arrives in the snapshot
    worker = server(log)

    async def scenario() -> None:
        feed = KVEventFeed(TOKEN)
        feed.sync({"w": worker.address})
        await until(lambda: feed.index.num_blocks("w", Tier.DEVICE) == 1, "the snapshot")
        assert feed.identities["w"].hash_salt == "salt"
        log.stored(h(2), Tier.DEVICE)
        log.removed(h(1), Tier.DEVICE)
        log.stored(h(1), Tier.HOST)
        await until(lambda: feed.index.seq("w") == log.seq, "the events")
        match = feed.index.match([h(1), h(2)], ["w"], "layout")["w"]
        assert (match.num_device_blocks, match.num_blocks) == (0, 2)
        feed.index._replicas["w"].seq -= 1  # the next batch now looks like it skipped one
        log.stored(h(3), Tier.DEVICE)
        await until(lambda: feed.num_connects == 2 and feed.index.seq("w") == log.seq,
                    "a resync after the gap")
        assert feed.index.num_blocks("w", Tier.DEVICE) == 2 and feed.index.num_gaps == 1
        feed.index.check_integrity()
        await feed.close()

    try:
        asyncio.run(scenario())
    finally:
        worker.close()


def test_a_worker_that_goes_away_loses_its_entries_at_once() -> None:
    log = KVEventLog()
    log.stored(h(1), Tier.DEVICE)
    worker = server(log)

    async def scenario() -> None:
        feed = KVEventFeed(TOKEN)
        feed.sync({"w": worker.address})
        await until(lambda: feed.index.replica_ids == ["w"], "the snapshot")
        started = time.monotonic()
        worker.close()  # its connections close as a killed process's would
        await until(lambda: feed.index.replica_ids == [], "the entries to go", timeout_s=1.0)
        assert time.monotonic() - started < 1.0
        feed.sync({})
        await feed.close()

    asyncio.run(scenario())


def test_a_subscriber_without_the_token_learns_nothing() -> None:
    log = KVEventLog()
    log.stored(h(1), Tier.DEVICE)
    worker = server(log)

    async def scenario() -> None:
        feed = KVEventFeed("wrong-token-0123456789abcdef")
        feed.sync({"w": worker.address})
        await until(lambda: worker.num_refused >= 2, "the worker to refuse it twice")
        assert feed.index.replica_ids == [] and feed.num_connects == 0
        await feed.close()

    try:
        asyncio.run(scenario())
    finally:
        worker.close()
    assert worker.num_subscribers == 0
