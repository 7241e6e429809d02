"""Child-process side of the test agent: the commands a test can run against real handoff roles.

Each method is one command; arguments and results are plain picklable data.
"""

from __future__ import annotations

import time
from dataclasses import asdict, fields
from typing import Any

import torch

from pdserve.engine.kv.layout import KVLayout
from pdserve.handoff import (
    HandoffError,
    HandoffReceiver,
    HandoffSender,
    HandoffTicket,
    HandoffTransport,
    OutboundTransfer,
)
from tests.handoff.handoff_faults import (
    clear_faults,
    install_receiver_faults,
    install_sender_faults,
)


def outcome(value: Any) -> dict[str, Any]:
    """A SendResult / FenceInfo / exception as plain data."""
    if isinstance(value, BaseException):
        return {"ok": False, "error": type(value).__name__, "code": getattr(value, "code", None),
                "message": str(value), "blocks_released": getattr(value, "blocks_released", None)}
    data = {f.name: getattr(value, f.name) for f in fields(value) if f.name != "error"}
    error = getattr(value, "error", None)
    return {**data, **(outcome(error) if error is not None else {"ok": True})}


def random_cache(layout: KVLayout, num_blocks: int, seed: int, device: str = "cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    cache = torch.randn(layout.cache_shape(num_blocks), generator=generator, dtype=torch.float32)
    return cache.to(dtype=layout.torch_dtype, device=device)


class Roles:
    def __init__(self, transport: HandoffTransport) -> None:
        self.transport = transport
        self.cache: torch.Tensor | None = None
        self.layout: KVLayout | None = None
        self.receiver: HandoffReceiver | None = None
        self.sender: HandoffSender | None = None
        self.transfers: dict[int, OutboundTransfer] = {}

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        if self.sender is not None:
            self.sender.close()

    # ---- setup ---------------------------------------------------------------------------
    def make_cache(self, layout: dict[str, Any], num_blocks: int, seed: int,
                   device: str = "cpu") -> dict[str, Any]:
        self.layout = KVLayout.from_dict(layout)
        self.cache = random_cache(self.layout, num_blocks, seed, device)
        return {"shape": list(self.cache.shape)}

    def make_receiver(self, **faults: Any) -> bool:
        """A fresh receiver; ``faults``: see `handoff_faults` (an agent plays one role)."""
        if self.receiver is not None:
            self.receiver.close()
        assert self.cache is not None and self.layout is not None
        clear_faults()
        install_receiver_faults(**faults)
        self.receiver = HandoffReceiver(self.transport, self.cache, self.layout)
        return True

    def make_sender(self, **faults: Any) -> bool:
        """A fresh sender; ``faults``: see `handoff_faults`."""
        if self.sender is not None:
            self.sender.close()
        device = self.cache.device if self.cache is not None else "cpu"
        clear_faults()
        install_sender_faults(**faults)
        self.sender = HandoffSender(self.transport, device=device)
        return True

    def read(self, block_ids: list[int], local_heads: list[int] | None = None) -> bytes:
        """The blocks' bytes; ``local_heads`` [start, end): only those of the cache's heads."""
        assert self.cache is not None
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.cache.device)
        picked = self.cache.index_select(2, ids)
        if local_heads is not None:
            picked = picked[..., local_heads[0]:local_heads[1], :]
        return picked.contiguous().cpu().view(torch.uint8).numpy().tobytes()

    def blocks_digest(self, block_ids: list[int]) -> int:
        """The device digest of these blocks' KV (gathered where the cache lives)."""
        from pdserve.handoff.digest import device_digest

        assert self.cache is not None
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.cache.device)
        return device_digest(self.cache.index_select(2, ids).contiguous())

    def now(self) -> float:
        return time.monotonic()

    # ---- receiver ------------------------------------------------------------------------------
    def reserve(self, request_id: str, block_ids: list[int], num_tokens: int,
                timeout_s: float = 10.0, layout: dict[str, Any] | None = None,
                kv_heads: list[int] | None = None) -> dict[str, Any]:
        assert self.receiver is not None and self.layout is not None
        use = KVLayout.from_dict(layout) if layout is not None else self.layout
        heads = None if kv_heads is None else (kv_heads[0], kv_heads[1])
        return self.receiver.reserve(request_id, block_ids, use, num_tokens,
                                     time.time() + timeout_s, heads).to_dict()

    def wait(self, request_id: str, timeout: float) -> dict[str, Any]:
        assert self.receiver is not None
        try:
            info = self.receiver.ready_future(request_id).result(timeout)
        except HandoffError as exc:
            return {**outcome(exc), "ended_at": time.monotonic()}
        return {**outcome(info), "ended_at": time.monotonic()}

    def wait_all(self, request_ids: list[str], timeout: float) -> dict[str, Any]:
        """`wait` over several reservations at once (`routes.all_ready`): ok only when every one
        verified; else the first failure."""
        from pdserve.handoff.routes import all_ready

        assert self.receiver is not None
        combined = all_ready([self.receiver.ready_future(r) for r in request_ids])
        try:
            infos = combined.result(timeout)
        except HandoffError as exc:
            return {**outcome(exc), "ended_at": time.monotonic()}
        return {"ok": True, "first_token_ids": [i.first_token_id for i in infos],
                "num_bytes": sum(i.num_bytes for i in infos), "ended_at": time.monotonic()}

    def cancel(self, request_id: str) -> bool | dict[str, Any]:
        """True/False as `HandoffReceiver.cancel` returns, or the error it raised as data."""
        assert self.receiver is not None
        try:
            return self.receiver.cancel(request_id)
        except HandoffError as exc:
            return outcome(exc)

    def receiver_stats(self) -> dict[str, Any]:
        assert self.receiver is not None
        stats = asdict(self.receiver.stats())
        stats["writable_block_ids"] = sorted(self.receiver.writable_block_ids())
        return stats

    # ---- sender ---------------------------------------------------------------------------------
    def start(self, ticket: dict[str, Any], block_ids: list[int],
              layers_per_piece: int | None = None) -> int:
        assert self.sender is not None and self.layout is not None
        transfer = self.sender.start_transfer(HandoffTicket.from_dict(ticket), block_ids,
                                              self.layout, layers_per_piece=layers_per_piece)
        handle = len(self.transfers)
        self.transfers[handle] = transfer
        return handle

    def send_layers(self, handles: list[int], layers: list[int]) -> float:
        """Call the per-layer hook like an engine's compute thread would; returns start time."""
        assert self.sender is not None and self.cache is not None
        started = time.monotonic()
        transfers = [self.transfers[h] for h in handles]
        for layer in layers:
            self.sender.send_layer(self.cache, layer, transfers)
        return started

    def fence(self, handles: list[int], first_token_id: int) -> bool:
        assert self.sender is not None
        for position, handle in enumerate(handles):  # distinct tokens prove fences don't mix
            self.sender.send_fence(self.transfers[handle], first_token_id + position)
        return True

    def push(self, tickets: list[dict[str, Any]], block_ids: list[list[int]],
             first_token_id: int, layers_per_piece: int | None = None) -> dict[str, Any]:
        """start + every layer (all transfers per layer, like one batch) + fence."""
        assert self.layout is not None
        handles = [self.start(t, ids, layers_per_piece)
                   for t, ids in zip(tickets, block_ids, strict=True)]
        started = self.send_layers(handles, list(range(self.layout.num_local_layers)))
        self.fence(handles, first_token_id)
        return {"handles": handles, "started_at": started}

    def released(self, handle: int) -> bool:
        return self.transfers[handle].released.done()

    def result(self, handle: int, timeout: float) -> dict[str, Any]:
        return outcome(self.transfers[handle].released.result(timeout))

    def cancel_push(self, handle: int) -> bool:
        assert self.sender is not None
        self.sender.cancel(self.transfers[handle])
        return True

    def sender_stats(self) -> dict[str, Any]:
        assert self.sender is not None
        return asdict(self.sender.stats())

    def send_frames(self, ticket: dict[str, Any], frames: list[tuple[int, dict[str, Any]]],
                    payloads: list[tuple[int, int, int]]) -> int:
        """Send raw ``(kind, body)`` frames over the sender's authenticated link to the
        ticket's receiver (bodies that break the schema are skipped), then payloads of random
        bytes ``(transfer id, piece index, byte count)``; each payload waits at most 1 s for a
        receiver to take it. Returns how many frames went out."""
        import asyncio

        from pdserve.handoff.wire import Kind, WireError, data_tag

        assert self.sender is not None
        sender = self.sender

        async def go() -> int:
            link = sender._link_for(HandoffTicket.from_dict(ticket))
            await link.ready
            sent = 0
            for kind, body in frames:
                try:
                    link.send(Kind(kind), body)
                    sent += 1
                except WireError:
                    continue
            for tid, index, nbytes in payloads:
                payload = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
                try:
                    await asyncio.wait_for(self.transport.send_payload(
                        link.endpoint, payload, data_tag(tid, index)), 1.0)
                except (TimeoutError, ValueError):
                    continue  # nobody took it (refused, or a tag outside the tag space)
            return sent
        return self.transport.submit(go()).result(60)

    def spy_host_copies(self) -> bool:
        """Count every copy of a CUDA tensor of more than 64 bytes to host memory from now on
        (``Tensor.cpu``, ``.to`` a CPU device, ``.numpy``, ``copy_`` into a CPU tensor); a
        digest's few sums are smaller. `host_copies` reports the count."""
        import torch

        self.num_host_copies = 0

        def big_cuda(tensor: torch.Tensor) -> bool:
            return tensor.is_cuda and tensor.numel() * tensor.element_size() > 64

        def counting(name: str, leaves_device: Any) -> None:
            original = getattr(torch.Tensor, name)

            def spy(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                if big_cuda(tensor) and leaves_device(tensor, *args, **kwargs):
                    self.num_host_copies += 1
                return original(tensor, *args, **kwargs)
            setattr(torch.Tensor, name, spy)

        def to_host(_: Any, *args: Any, **kwargs: Any) -> bool:
            target = kwargs.get("device", args[0] if args else None)
            if isinstance(target, torch.Tensor):
                return not target.is_cuda
            if target is None or isinstance(target, torch.dtype):
                return False
            return torch.device(target).type == "cpu"

        counting("cpu", lambda *_, **__: True)
        counting("numpy", lambda *_, **__: True)
        counting("to", to_host)
        original_copy = torch.Tensor.copy_

        def copy_spy(dst: torch.Tensor, src: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not dst.is_cuda and big_cuda(src):
                self.num_host_copies += 1
            return original_copy(dst, src, *args, **kwargs)
        torch.Tensor.copy_ = copy_spy  # type: ignore[method-assign]
        return True

    def host_copies(self) -> int:
        return self.num_host_copies
