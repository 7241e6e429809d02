"""Prefix loads from the host tier, another worker or the shared store into device blocks:
chosen at admission by measured cost, and fenced: the request computes only after its copy
completed and verified.

The scheduler's collaborator for LOADING_KV requests; metadata only (a callback copies).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.engine.kv.events import Tier
from pdserve.engine.kv.manager import KVCacheManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.tiers.cost import KVCostModel, KVReuse

# (request id, the plan, device blocks to write); the copy's end comes back through
# `Scheduler.finish_load`.
LoadSubmit = Callable[[str, "LoadPlan", list[int]], None]
# How many of these block hashes, from the first, the shared store holds.
StoreLookup = Callable[[list[bytes]], int]
# How many of the request's prompt blocks, from the first, another worker holds.
PeerLookup = Callable[[str], int]


@dataclass(frozen=True)
class LoadPlan:
    """Where the blocks after a request's device prefix come from: host blocks, or the
    shared store's (or a peer worker's) blocks of these hashes, from block ``first_block``."""

    tier: Tier
    host_ids: list[int]
    hashes: list[bytes]
    first_block: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.host_ids) if self.tier is Tier.HOST else len(self.hashes)


@dataclass
class _Loading:
    request: Request
    plan: LoadPlan
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

    def __init__(self, kv: KVCacheManager, cost: KVCostModel,
                 bytes_per_block: dict[Tier, int], submit: LoadSubmit,
                 store_lookup: StoreLookup | None = None,
                 peer_lookup: PeerLookup | None = None) -> None:
        self.kv = kv
        self.cost = cost
        self.bytes_per_block = bytes_per_block
        self.submit = submit
        self.store_lookup = store_lookup
        self.peer_lookup = peer_lookup
        self._loading: dict[str, _Loading] = {}
        self.num_failures: dict[str, int] = {}  # by reason

    @property
    def num_loading(self) -> int:
        """Requests whose copy is in flight, aborted ones included (they hold blocks)."""
        return len(self._loading)

    def is_loading(self, request_id: str) -> bool:
        return request_id in self._loading

    def plan(self, request: Request, num_device_blocks: int) -> LoadPlan | None:
        """What is worth loading after the request's cached device prefix (the host tier
        first, else the shared store), or None (compute). Records the decision on the
        request at its first admission."""
        bs = self.kv.block_size
        plan = None if request.skip_tier_loads else self._find(request, num_device_blocks)
        if plan is None:
            if request.kv_reuse is None:
                request.kv_reuse = KVReuse(num_device_tokens=num_device_blocks * bs)
            return None
        num_tokens = plan.num_blocks * bs
        decision = self.cost.decide(plan.tier.value, num_tokens,
                                    plan.num_blocks * self.bytes_per_block[plan.tier],
                                    (num_device_blocks + plan.num_blocks) * bs)
        request.kv_reuse = KVReuse(num_device_tokens=num_device_blocks * bs, decision=decision)
        return plan if decision.load else None

    def _find(self, request: Request, num_device_blocks: int) -> LoadPlan | None:
        host_ids = self.kv.find_host_continuation(request, num_device_blocks)
        peer = self._peer_plan(request, num_device_blocks, len(host_ids))
        if peer is not None:
            return peer
        if host_ids:
            return LoadPlan(Tier.HOST, host_ids, [])
        if self.store_lookup is None:
            return None
        max_blocks = (request.num_tokens - 1) // self.kv.block_size
        hashes = self.kv.block_hashes(request, num_device_blocks, max_blocks)
        found = self.store_lookup(hashes) if hashes else 0
        return LoadPlan(Tier.STORE, [], hashes[:found]) if found else None

    def _peer_plan(self, request: Request, num_device_blocks: int,
                   num_host_blocks: int) -> LoadPlan | None:
        """A peer's blocks after the device prefix, when the peer holds more of the prompt
        than this worker's device and host tiers together (never the last token's block)."""
        if self.peer_lookup is None:
            return None
        max_blocks = (request.num_tokens - 1) // self.kv.block_size
        held = min(self.peer_lookup(request.request_id), max_blocks)
        if held <= num_device_blocks + num_host_blocks:
            return None
        hashes = self.kv.block_hashes(request, num_device_blocks, held)
        return LoadPlan(Tier.PEER, [], hashes, num_device_blocks)

    def start(self, request: Request, cached_ids: list[int], plan: LoadPlan) -> bool:
        """Own the blocks and start the copy; False (nothing changed) when they do not fit."""
        new_ids = self.kv.allocate_slots(request, plan.num_blocks * self.kv.block_size,
                                         cached_ids)
        if new_ids is None:
            return False
        assert len(new_ids) == plan.num_blocks
        if plan.tier is Tier.HOST:
            assert self.kv.host_pool is not None
            self.kv.host_pool.begin_read(plan.host_ids)
        self._loading[request.request_id] = _Loading(request, plan, len(cached_ids))
        request.status = RequestStatus.LOADING_KV
        self.submit(request.request_id, plan, new_ids)
        return True

    def abort(self, request_id: str) -> None:
        """The request ended while its copy writes: its blocks are freed at `finish`."""
        self._loading[request_id].aborted = True

    def finish(self, request_id: str, error: str | None,
               seconds: float) -> tuple[Request, bool] | None:
        """The copy ended. Returns (request, whether its loaded prefix counts); None when the
        request was aborted meanwhile (its blocks are freed here)."""
        entry = self._loading.pop(request_id)
        if entry.plan.tier is Tier.HOST:
            assert self.kv.host_pool is not None
            self.kv.host_pool.end_read(entry.plan.host_ids)
        request = entry.request
        if entry.aborted:
            self.kv.free(request)
            return None
        reuse = request.kv_reuse or KVReuse()
        decision = reuse.decision
        if error is not None:
            reason = error if error.isidentifier() else ("digest" if "digest" in error
                                                         else "copy")
            self.num_failures[reason] = self.num_failures.get(reason, 0) + 1
            request.kv_reuse = dataclasses.replace(reuse, failure=reason)
            return request, False
        num_loaded = entry.plan.num_blocks * self.kv.block_size
        if decision is not None:
            self.cost.observe_transfer(decision.tier, decision.num_bytes, seconds)
        request.kv_reuse = dataclasses.replace(reuse, num_loaded_tokens=num_loaded,
                                               load_s=seconds)
        request.num_computed_tokens = (entry.num_device_blocks + entry.plan.num_blocks) * \
            self.kv.block_size
        return request, True

    def loading_requests(self) -> list[Request]:
        return [e.request for e in self._loading.values() if not e.aborted]

