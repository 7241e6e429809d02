"""Tickets, config, staging pool and staging admission (no UCX)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest

from pdserve.engine.kv.layout import KVLayout
from pdserve.handoff.config import HandoffConfig
from pdserve.handoff.errors import HandoffDigestError, HandoffError, error_from_code
from pdserve.handoff.staging import StagingAdmission, StagingPool
from pdserve.handoff.ticket import HandoffTicket

LAYOUT = KVLayout("fp", "float16", block_size=16, num_layers=4, num_kv_heads=2, head_dim=64)


def make_ticket(**changes: object) -> HandoffTicket:
    values: dict[str, object] = {
        "request_id": "r", "transfer_id": 5, "receiver_address": b"\x01addr",
        "receiver_instance": 9, "receiver_host": "h/boot", "num_blocks": 3, "num_tokens": 40,
        "expected_bytes": 4 * 3 * LAYOUT.block_bytes, "max_piece_bytes": 1 << 20,
        "deadline": 1.7e9, "layout": LAYOUT,
    }
    values.update(changes)
    return HandoffTicket(**values)  # type: ignore[arg-type]


def test_ticket_round_trips_through_msgpack() -> None:
    for ticket in (make_ticket(), make_ticket(kv_heads=(1, 2),
                                              expected_bytes=4 * 3 * LAYOUT.block_bytes // 2)):
        wire = msgpack.unpackb(msgpack.packb(ticket.to_dict(), use_bin_type=True), raw=False)
        assert HandoffTicket.from_dict(wire) == ticket
    assert make_ticket().kv_heads == (0, 2)  # all the cache's heads when none are named


@pytest.mark.parametrize("changes, reason", [
    ({"transfer_id": 0}, "transfer_id"),
    ({"num_tokens": 49}, "do not fit"),
    ({"expected_bytes": 1}, "expected_bytes"),
    ({"protocol_version": 1}, "protocol version"),
    ({"kv_heads": (1, 2)}, "expected_bytes"),  # half the heads: half the bytes
    ({"kv_heads": (1, 3)}, "outside the layout"),
])
def test_inconsistent_tickets_are_refused(changes: dict, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        make_ticket(**changes)


def test_ticket_dicts_are_checked_field_by_field() -> None:
    good = make_ticket().to_dict()
    for bad, reason in (({**good, "surprise": 1}, "unknown"),
                        ({**good, "transfer_id": "5"}, "transfer_id"),
                        ({**good, "receiver_address": "text"}, "bytes"),
                        ({**good, "layout": "fp16"}, "layout"),
                        ({**good, "kv_heads": [0]}, "kv_heads")):
        with pytest.raises((TypeError, ValueError), match=reason):
            HandoffTicket.from_dict(bad)


def _config(**changes: Any) -> HandoffConfig:
    values: dict[str, Any] = {"auth_token": "s3cret", "timeout_s": 30.0, "net_devices": None,
                              "ucx_transports": "^cma", "receiver_staging_bytes": 64 << 20,
                              "sender_staging_bytes": 64 << 20}
    return HandoffConfig(**(values | changes))


def test_config_checks_its_bounds_and_builds_ucx_options() -> None:
    config = _config(ucx_transports="tcp,self", net_devices="eth0")
    assert config.ucx_options()["TLS"] == "tcp,self" and config.ucx_options()["NET_DEVICES"]
    assert config.ucx_options()["RNDV_THRESH"] == "8192"
    assert _config().ucx_options()["TLS"] == "^cma"
    with pytest.raises(ValueError, match="auth_token"):
        _config(auth_token="")
    with pytest.raises(ValueError, match="must exceed"):
        _config(peer_timeout_s=0.1, heartbeat_interval_s=0.5)
    with pytest.raises(ValueError, match="at least one piece"):
        _config(receiver_staging_bytes=1 << 20, max_piece_bytes=2 << 20)


def test_errors_cross_the_wire_by_code() -> None:
    rebuilt = error_from_code("digest", "piece 3 hashes wrong")
    assert isinstance(rebuilt, HandoffDigestError) and str(rebuilt) == "piece 3 hashes wrong"
    assert type(error_from_code("from-the-future", "?")) is HandoffError


def test_staging_pool_bounds_reuses_and_quarantines() -> None:
    pool = StagingPool(1 << 20)
    a = pool.try_acquire(300_000)  # class 320 KiB
    b = pool.try_acquire(200_000)  # class 224 KiB
    assert a is not None and b is not None and a.numel() >= 300_000
    assert pool.try_acquire(520_000) is None  # 320 + 224 + 512 KiB > 1 MiB
    pool.release(a)
    again = pool.try_acquire(299_000)  # the same class
    assert again is not None and again.data_ptr() == a.data_ptr()  # reused, no new pages
    pool.quarantine(b)  # UCX may still touch it: never handed out again
    stats = pool.stats()
    assert (stats.in_use_bytes, stats.num_quarantined, stats.num_refused) == (320 << 10, 1, 1)
    fresh = [pool.try_acquire(200_000) for _ in range(2)]
    assert all(f is not None and f.data_ptr() != b.data_ptr() for f in fresh)
    pool.check_integrity()
    with pytest.raises(ValueError):
        pool.release(b)


def test_staging_classes_waste_at_most_an_eighth_and_never_exceed_the_capacity() -> None:
    """handoff.staging_buffer_mb: 12 holds a 12 MiB piece (a power-of-two class of 16 MiB
    would not fit, and the request would be recomputed)."""
    mib = 1 << 20
    pool = StagingPool(12 * mib)
    assert pool.size_class(12 * mib) == 12 * mib and pool.fits_ever(12 * mib)
    whole = pool.try_acquire(12 * mib)
    assert whole is not None and whole.numel() == 12 * mib
    assert not pool.fits_ever(12 * mib + 1)
    odd = StagingPool(10 * mib + 5)
    assert odd.size_class(10 * mib + 3) == 10 * mib + 5  # capped: 11 MiB would not fit
    for nbytes in (65_537, 3 * mib + 1, 8 * mib + 1, 11 * mib + 12_345, 100 * mib + 7):
        size = StagingPool(1 << 40).size_class(nbytes)
        assert nbytes <= size <= nbytes * 9 // 8 + 1, (nbytes, size)
    # Nearly equal pieces share a class, so their buffers are reused.
    assert pool.size_class(5 * mib - 1000) == pool.size_class(5 * mib)


def test_admission_is_first_come_first_served_and_skips_ended_transfers() -> None:
    async def scenario() -> list[str]:
        pool = StagingPool(1 << 20)
        admission = StagingAdmission(pool)
        held = pool.try_acquire(1 << 20)
        assert held is not None
        order: list[str] = []
        ended = {"b": False}

        async def want(name: str, nbytes: int) -> None:
            buffer = await admission.acquire(nbytes, lambda: ended.get(name, False))
            order.append(f"{name}:{'none' if buffer is None else 'buf'}")
            if buffer is not None:
                admission.release(buffer)

        tasks = [asyncio.create_task(want(n, 600_000)) for n in ("a", "b", "c")]
        await asyncio.sleep(0)
        ended["b"] = True
        admission.release(held)
        await asyncio.gather(*tasks)
        pool.check_integrity()
        return order

    assert asyncio.run(scenario()) == ["a:buf", "b:none", "c:buf"]
