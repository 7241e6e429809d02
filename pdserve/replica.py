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
    queue_seq: int = 0  # prefill: changes to that queue so far (a higher count is newer)
    kv_events_address: str = ""  # "host:port" of its KV event plane ("" : none)
    # Decode: prompt tokens a second its steps would take from a long prompt within the TPOT
    # bound, and what one prompt token costs a step in us (0: none, or not measured yet).
    lend_tokens_per_s: int = 0
    prompt_token_us: int = 0
    # The KV tiers beside the device: host blocks held, requests whose prefix is loading now;
    # cumulative: loads (host, and pulls from peer workers) and their bytes and seconds, loads
    # that failed (computed instead).
    num_host_blocks: int = 0
    num_host_cached_blocks: int = 0
    num_host_loads: int = 0
    num_host_load_bytes: int = 0
    host_load_ms: int = 0
    num_load_failures: int = 0
    num_loading: int = 0
    num_peer_loads: int = 0
    num_peer_load_bytes: int = 0
    peer_load_ms: int = 0
    # Steps so far that ran with idle workers' cores lent (engine.cpu_lending; cumulative).
    num_lent_steps: int = 0

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0

    def to_stats(self) -> dict[str, int | str]:
        """The plain dict Serve carries (its routing stats are a dict)."""
        return asdict(self)

    @classmethod
    def from_stats(cls, stats: Mapping[str, Any]) -> WorkerLoad | None:
        """The load in Serve's routing stats; None before the replica's first report."""
        if "num_blocks" not in stats:
            return None
        return cls(**{f.name: (str if f.type in (str, "str") else int)(stats[f.name])
                      for f in fields(cls) if f.name in stats})


@dataclass(frozen=True)
class PrefillQueue:
    """A prefill worker's queue of prompt tokens accepted and not prefilled yet, with the
    count of changes that made it: of two views of one worker's queue (a load report Serve
    relays up to a period late, the view a finished prefill carries back), the higher
    ``seq`` is the newer."""

    seq: int = 0
    num_tokens: int = 0

    def add(self, num_tokens: int) -> PrefillQueue:
        return PrefillQueue(self.seq + 1, self.num_tokens + num_tokens)


def tier_load(stats: Any) -> dict[str, int]:
    """The `WorkerLoad` fields of an engine's `TierStats` (read without importing it)."""
    return {"num_host_blocks": stats.num_host_blocks,
            "num_host_cached_blocks": stats.num_host_cached_blocks,
            "num_host_loads": stats.num_host_loads,
            "num_host_load_bytes": stats.num_host_load_bytes,
            "host_load_ms": int(stats.host_load_seconds * 1000),
            "num_load_failures": stats.num_load_failures,
            "num_loading": stats.num_loading,
            "num_peer_loads": stats.num_peer_loads,
            "num_peer_load_bytes": stats.num_peer_load_bytes,
            "peer_load_ms": int(stats.peer_load_seconds * 1000)}
