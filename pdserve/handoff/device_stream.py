"""The handoff's own CUDA stream: gathers, scatters and digests run there, ordered after the
engine's work by events, never queued behind the engine's next forward pass. Host memory has
no stream: every method is then a no-op.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class HandoffStream:
    """One side stream per handoff role and device. Thread-safe (streams and events are)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def after_engine(self) -> Iterator[None]:
        """Run the block on the handoff stream after everything the calling thread's current
        stream (the engine's) queued so far: a layer's gather sees that layer's writes."""
        if self.stream is None:
            yield
            return
        written = torch.cuda.Event()
        written.record(torch.cuda.current_stream(self.device))
        self.stream.wait_event(written)
        with torch.cuda.stream(self.stream):
            yield

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Run the block on the handoff stream (its own order only)."""
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            yield

    def record(self) -> Any:
        """An event after the work queued on the handoff stream so far (None on host)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def to_device(self, ids: list[int] | tuple[int, ...]) -> torch.Tensor:
        """Block ids as an int64 tensor on the device, copied from pinned memory on the
        handoff stream: the calling thread never waits for the engine's queued work."""
        host = torch.tensor(ids, dtype=torch.int64)
        if self.stream is None:
            return host
        with torch.cuda.stream(self.stream):
            return host.pin_memory().to(self.device, non_blocking=True)
