"""Prefix loads from the host tier into device blocks: chosen at admission by measured cost,
and fenced: the request computes only after its copy completed and verified.

The scheduler's collaborator for LOADING_KV requests; metadata only (a callback copies).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.kv_cost import KVCostModel, KVReuse
from pdserve.engine.kv_events import Tier
from pdserve.engine.request import Request, RequestStatus

# (request id, device blocks to write, host blocks to read); the copy's end comes back
# through `Scheduler.finish_load`.
LoadSubmit = Callable[[str, list[int], list[int]], None]


@dataclass
class _Loading:
    request: Request
    host_ids: list[int]
    num_device_blocks: int
    started_at: float = field(default_factory=time.monotonic)
    aborted: bool = False  # finished from outside while the copy still writes


class TierLoads:
    """Which requests load which host blocks.

    Contract: `start` makes the request own device blocks for its cached prefix and the
    loaded one, and marks the host blocks read; until `finish` nothing schedules the request
    or frees those blocks (an abort only marks it). `finish` ends the host reads and hands
    the request back for the scheduler to run, requeue (the load failed: it computes the
    prefix instead) or free (aborted).
    """

    def __init__(self, kv: KVCacheManager, cost: KVCostModel, bytes_per_block: int,
                 submit: LoadSubmit) -> None:
        self.kv = kv
        self.cost = cost
        self.bytes_per_block = bytes_per_block
        self.submit = submit
        self._loading: dict[str, _Loading] = {}
        self.num_failures: dict[str, int] = {}  # by reason

    @property
    def num_loading(self) -> int:
        """Requests whose copy is in flight, aborted ones included (they hold blocks)."""
        return len(self._loading)

    def is_loading(self, request_id: str) -> bool:
        return request_id in self._loading

    def plan(self, request: Request, num_device_blocks: int) -> list[int] | None:
        """Host blocks worth loading after the request's cached device prefix, or None
        (compute). Records the decision on the request at its first admission."""
        bs = self.kv.block_size
        host_ids = [] if request.skip_tier_loads else self.kv.find_host_continuation(
            request, num_device_blocks)
        if not host_ids:
            if request.kv_reuse is None:
                request.kv_reuse = KVReuse(num_device_tokens=num_device_blocks * bs)
            return None
        num_tokens = len(host_ids) * bs
        decision = self.cost.decide(Tier.HOST.value, num_tokens,
                                    len(host_ids) * self.bytes_per_block,
                                    (num_device_blocks + len(host_ids)) * bs)
        request.kv_reuse = KVReuse(num_device_tokens=num_device_blocks * bs, decision=decision)
        return host_ids if decision.load else None

    def start(self, request: Request, cached_ids: list[int], host_ids: list[int]) -> bool:
        """Own the blocks and start the copy; False (nothing changed) when they do not fit."""
        new_ids = self.kv.allocate_slots(request, len(host_ids) * self.kv.block_size, cached_ids)
        if new_ids is None:
            return False
        assert self.kv.host_pool is not None and len(new_ids) == len(host_ids)
        self.kv.host_pool.begin_read(host_ids)
        self._loading[request.request_id] = _Loading(request, host_ids, len(cached_ids))
        request.status = RequestStatus.LOADING_KV
        self.submit(request.request_id, new_ids, host_ids)
        return True

    def abort(self, request_id: str) -> None:
        """The request ended while its copy writes: its blocks are freed at `finish`."""
        self._loading[request_id].aborted = True

    def finish(self, request_id: str, error: str | None,
               seconds: float) -> tuple[Request, bool] | None:
        """The copy ended. Returns (request, whether its loaded prefix counts); None when the
        request was aborted meanwhile (its blocks are freed here)."""
        entry = self._loading.pop(request_id)
        assert self.kv.host_pool is not None
        self.kv.host_pool.end_read(entry.host_ids)
        request = entry.request
        if entry.aborted:
            self.kv.free(request)
            return None
        reuse = request.kv_reuse or KVReuse()
        decision = reuse.decision
        if error is not None:
            reason = "digest" if "digest" in error else "copy"
            self.num_failures[reason] = self.num_failures.get(reason, 0) + 1
            request.kv_reuse = dataclasses.replace(reuse, failure=reason)
            return request, False
        num_loaded = len(entry.host_ids) * self.kv.block_size
        if decision is not None:
            self.cost.observe_transfer(decision.tier, decision.num_bytes, seconds)
        request.kv_reuse = dataclasses.replace(reuse, num_loaded_tokens=num_loaded,
                                               load_s=seconds)
        request.num_computed_tokens = (entry.num_device_blocks + len(entry.host_ids)) * \
            self.kv.block_size
        return request, True

    def loading_requests(self) -> list[Request]:
        return [e.request for e in self._loading.values() if not e.aborted]

