"""What a worker replica reports about itself: its load, one record for every reader.

Shared by the prefill and decode workers; read by their request routers and the ingress.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True, kw_only=True)
class WorkerLoad:
    """A worker replica's KV pool and queues, reported once: Serve calls the worker's
    `record_routing_stats` on the role's timer and hands the answer (`to_stats`) both to the
    role's request router and to the ingress (`router/roles.py`)."""

    num_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int  # requests not running yet (decode: those awaiting KV too)
    num_queued_tokens: int = 0  # prefill: prompt tokens accepted and not prefilled yet

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0

    def to_stats(self) -> dict[str, int]:
        """The plain dict Serve carries (its routing stats are a dict)."""
        return asdict(self)

    @classmethod
    def from_stats(cls, stats: Mapping[str, Any]) -> WorkerLoad | None:
        """The load in Serve's routing stats; None before the replica's first report."""
        if "num_blocks" not in stats:
            return None
        return cls(**{f.name: int(stats[f.name]) for f in fields(cls) if f.name in stats})
