"""Child-process side of the test agent: the commands a test can run against real handoff roles.

Each method is one command; arguments and results are plain picklable data.
"""

from __future__ import annotations

import time
from dataclasses import asdict, fields
from typing import Any

import torch

from pdserve.engine.kv_layout import KVLayout
from pdserve.handoff import (
    HandoffError,
    HandoffReceiver,
    HandoffSender,
    HandoffTicket,
    HandoffTransport,
    OutboundTransfer,
)
from pdserve.handoff.faults import ReceiverFaults, SenderFaults


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
                   device: str = "cpu", shared: bool = False) -> dict[str, Any]:
        """Random KV; ``shared``: in memory same-host peers can map (what a sender exports)."""
        self.layout = KVLayout.from_dict(layout)
        values = random_cache(self.layout, num_blocks, seed, device)
        if shared:
            memory = self.transport.share_host_memory(values.numel() * values.element_size())
            self.cache = memory.view(values.dtype).view(values.shape)
            self.cache.copy_(values)
        else:
            self.cache = values
        return {"shape": list(self.cache.shape)}

    def make_receiver(self, recv_delay_s: float = 0.0,
                      corrupt_read_piece: int | None = None) -> bool:
        if self.receiver is not None:
            self.receiver.close()
        assert self.cache is not None and self.layout is not None
        self.receiver = HandoffReceiver(self.transport, self.cache, self.layout,
                                        faults=ReceiverFaults(recv_delay_s, corrupt_read_piece))
        return True

    def make_sender(self, corrupt_piece: int | None = None, inflate_piece_bytes: int = 0,
                    source_address_shift: int = 0,
                    corrupt_slot_record: int | None = None,
                    begin_frames_delay_s: float = 0.0) -> bool:
        if self.sender is not None:
            self.sender.close()
        device = self.cache.device if self.cache is not None else "cpu"
        self.sender = HandoffSender(self.transport, device=device, faults=SenderFaults(
            corrupt_piece=corrupt_piece, inflate_piece_bytes=inflate_piece_bytes,
            source_address_shift=source_address_shift, corrupt_slot_record=corrupt_slot_record,
            begin_frames_delay_s=begin_frames_delay_s))
        # A cache in shared memory is exported: same-host receivers read it themselves.
        return self.cache is not None and self.sender.export_cache(self.cache)

    def read(self, block_ids: list[int]) -> bytes:
        assert self.cache is not None
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.cache.device)
        picked = self.cache.index_select(2, ids).contiguous().cpu()
        return picked.view(torch.uint8).numpy().tobytes()

    def now(self) -> float:
        return time.monotonic()

    # ---- receiver ------------------------------------------------------------------------------
    def reserve(self, request_id: str, block_ids: list[int], num_tokens: int,
                timeout_s: float = 10.0, layout: dict[str, Any] | None = None) -> dict[str, Any]:
        assert self.receiver is not None and self.layout is not None
        use = KVLayout.from_dict(layout) if layout is not None else self.layout
        return self.receiver.reserve(request_id, block_ids, use, num_tokens,
                                     time.time() + timeout_s).to_dict()

    def wait(self, request_id: str, timeout: float) -> dict[str, Any]:
        assert self.receiver is not None
        try:
            info = self.receiver.wait_ready(request_id, timeout)
        except HandoffError as exc:
            return {**outcome(exc), "ended_at": time.monotonic()}
        return {**outcome(info), "ended_at": time.monotonic()}

    def cancel(self, request_id: str) -> bool | dict[str, Any]:
        """True/False as `HandoffReceiver.cancel` returns, or the error it raised as data."""
        assert self.receiver is not None
        try:
            return self.receiver.cancel(request_id)
        except HandoffError as exc:
            return outcome(exc)

    def peer_maps_writable(self) -> dict[int, bool]:
        """Size of each region mapped from a same-host sender -> can it be written through."""
        assert self.receiver is not None
        maps = self.receiver._sources._maps
        return {peer.nbytes: bool(peer.array.flags.writeable) for regions in maps.values()
                for peer in regions.values()}

    def stall_direct_write(self, request_id: str) -> bool:
        """Stand in for a UCX receive into the blocks that never ends (a sender stalled
        mid-message): what the receiver's write watchdog exists for."""
        assert self.receiver is not None
        record = self.receiver._by_request[request_id]
        with record.write_lock:
            return record.begin_direct_write()

    def end_stalled_write(self, request_id: str) -> bool:
        assert self.receiver is not None
        record = self.receiver._by_request[request_id]
        self.receiver._landing._direct_write_ended(record)
        return record.settled.is_set()

    def receiver_stats(self) -> dict[str, Any]:
        assert self.receiver is not None
        stats = asdict(self.receiver.stats())
        stats["writable_block_ids"] = sorted(self.receiver.writable_block_ids())
        return stats

    # ---- sender ---------------------------------------------------------------------------------
    def start(self, ticket: dict[str, Any], block_ids: list[int],
              layers_per_piece: int | None = None, direct_min_bytes: int | None = None,
              allow_reads: bool = True, allow_slots: bool = True) -> int:
        assert self.sender is not None and self.layout is not None
        transfer = self.sender.start_transfer(HandoffTicket.from_dict(ticket), block_ids,
                                              self.layout, layers_per_piece=layers_per_piece,
                                              direct_min_bytes=direct_min_bytes,
                                              allow_reads=allow_reads, allow_slots=allow_slots)
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
             first_token_id: int, layers_per_piece: int | None = None,
             direct_min_bytes: int | None = None, allow_reads: bool = True,
             allow_slots: bool = True) -> dict[str, Any]:
        """start + every layer (all transfers per layer, like one batch) + fence."""
        assert self.layout is not None
        handles = [self.start(t, ids, layers_per_piece, direct_min_bytes, allow_reads,
                              allow_slots)
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

    def thread_names(self) -> dict[int, str]:
        import threading
        return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}

    def profile_loop(self, on: bool) -> str:
        import cProfile
        import io
        import pstats
        async def toggle() -> str:
            if on:
                self._prof = cProfile.Profile()
                self._prof.enable()
                return ""
            self._prof.disable()
            out = io.StringIO()
            pstats.Stats(self._prof, stream=out).sort_stats("tottime").print_stats(40)
            return out.getvalue()
        return self.transport.submit(toggle()).result(10)
