"""The two processes `handoff_bandwidth.py` measures between: a handoff role (pdserve's
handoff, or raw UCXX tagged sends of the same pieces) and a plain TCP socket's two ends.

Each is driven over a pipe by (op, args) messages; `cross_host.py` runs the handoff role on
namespace hosts.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

MIB = 1 << 20
NUM_LAYERS = 32
# Piece sizes are the production defaults; staging holds a whole 256 MiB transfer.
BENCH_CONFIG: dict[str, Any] = {
    "auth_token": "bench-secret", "receiver_staging_bytes": 512 * MIB,
    "sender_staging_bytes": 512 * MIB, "timeout_s": 60.0, "net_devices": None,
    "ucx_transports": "^cma",
}


def bench_layout() -> Any:
    """A Llama-like KV slice: 32 layers x 8 KV heads x 64 dims, fp16, 16-token blocks, so one
    block across all layers is exactly 1 MiB and an N MiB payload is N blocks."""
    from pdserve.engine.kv.layout import KVLayout

    return KVLayout("bench", "float16", block_size=16, num_layers=NUM_LAYERS, num_kv_heads=8,
                    head_dim=64)


RAW_TAG = 0xBE << 56


def handoff_worker(conn: Any, role: str, num_cache_blocks: int) -> None:
    """One handoff role in its own process, driven by (op, args) tuples over a pipe: handoff
    transfers, and raw UCXX sends of the same sizes over the same transport."""
    import torch

    from pdserve.handoff import (
        HandoffConfig,
        HandoffReceiver,
        HandoffSender,
        HandoffTicket,
        HandoffTransport,
    )

    layout = bench_layout()
    cache = torch.randn(layout.cache_shape(num_cache_blocks)).to(layout.torch_dtype)
    raw = np.random.randint(0, 255, num_cache_blocks * MIB, dtype=np.uint8)
    transport = HandoffTransport(HandoffConfig(**BENCH_CONFIG)).start()
    receiver = HandoffReceiver(transport, cache, layout) if role == "receiver" else None
    sender = HandoffSender(transport) if role == "sender" else None
    stamps: dict[str, float] = {}
    conn.send("up")
    while True:
        op, args = conn.recv()
        if op == "stop":
            transport.stop()
            conn.send("stopped")
            return
        if op == "identity":
            conn.send((transport.address, transport.host))
        elif op == "reserve" and receiver is not None:
            request_id, block_ids = args
            ticket = receiver.reserve(request_id, block_ids, layout, len(block_ids) * 16)
            future = receiver.ready_future(request_id)
            future.add_done_callback(_stamper(stamps, request_id))
            conn.send(ticket.to_dict())
        elif op == "wait" and receiver is not None:
            info = receiver.ready_future(args).result(timeout=60)
            conn.send((stamps[args], info.num_bytes))
        elif op == "push" and sender is not None:
            ticket, block_ids = args
            transfer = sender.start_transfer(HandoffTicket.from_dict(ticket), block_ids, layout)
            started = time.monotonic()
            for layer in range(layout.num_local_layers):  # the engine's per-layer hook
                sender.send_layer(cache, layer, [transfer])
            sender.send_fence(transfer, 1)
            result = transfer.released.result(60)
            conn.send((started, result.ok, str(result.error)))
        elif op == "raw_post":
            posted = threading.Event()
            done = transport.submit(_raw_post(raw, posted, *args))
            posted.wait(30)
            conn.send("posted")
            conn.send(done.result(60))
        elif op == "raw_send":
            conn.send(transport.submit(_raw_send(transport, raw, *args)).result(60))


async def _raw_post(buffer: np.ndarray, posted: threading.Event, rep: int,
                    sizes: list[int]) -> float:
    """Post one receive per piece into ``buffer`` (all posted before ``posted`` is set);
    return when the last one completed."""
    import asyncio

    import ucxx  # type: ignore[import-untyped]
    from ucxx._lib.arr import Array  # type: ignore[import-untyped]
    from ucxx.types import Tag  # type: ignore[import-untyped]

    worker = ucxx.core._get_ctx().worker
    offsets = np.cumsum([0, *sizes]).tolist()
    requests = [worker.tag_recv(Array(buffer[offsets[i]:offsets[i + 1]]),
                                Tag(RAW_TAG | rep << 16 | i)) for i in range(len(sizes))]
    posted.set()
    await asyncio.gather(*(request.wait() for request in requests))
    return time.monotonic()


_RAW_ENDPOINTS: dict[bytes, Any] = {}


async def _raw_send(transport: Any, buffer: np.ndarray, address: bytes, host: str, rep: int,
                    sizes: list[int]) -> float:
    """Send ``sizes`` bytes from ``buffer`` as that many tagged messages at once; return the
    start time."""
    import asyncio

    endpoint = _RAW_ENDPOINTS.get(address)
    if endpoint is None:
        endpoint = _RAW_ENDPOINTS[address] = await transport.open_endpoint(address, host,
                                                                           lambda: None)
    offsets = np.cumsum([0, *sizes]).tolist()
    started = time.monotonic()
    await asyncio.gather(*(transport.send_payload(endpoint, buffer[offsets[i]:offsets[i + 1]],
                                                  RAW_TAG | rep << 16 | i)
                           for i in range(len(sizes))))
    return started


def _stamper(stamps: dict[str, float], key: str) -> Callable[[object], None]:
    """Records when the ready future resolved, on the thread that resolved it."""
    def stamp(_: object) -> None:
        stamps[key] = time.monotonic()
    return stamp


def tcp_receiver(conn: Any, max_bytes: int) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    conn.send(server.getsockname()[1])
    peer, _ = server.accept()
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 * MIB)
    buffer = memoryview(bytearray(max_bytes))
    while True:
        nbytes = conn.recv()
        if nbytes == 0:
            return
        got = 0
        while got < nbytes:
            got += peer.recv_into(buffer[got:nbytes])
        conn.send(time.monotonic())


def tcp_sender(conn: Any, port: int, max_bytes: int) -> None:
    peer = socket.create_connection(("127.0.0.1", port))
    peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 * MIB)
    payload = memoryview(np.random.randint(0, 255, max_bytes, dtype=np.uint8).tobytes())
    while True:
        nbytes = conn.recv()
        if nbytes == 0:
            return
        started = time.monotonic()
        peer.sendall(payload[:nbytes])
        conn.send(started)
