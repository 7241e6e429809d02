"""The scheduler's invariant: request states, queues, batch seats and block ownership agree.

Tests call it after every step; `LLMEngine.kv_stats` before it reports. It changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from pdserve.engine.kv.manager import KVCacheManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler_output import SchedulerConfig


class SchedulerState(Protocol):
    """What the check reads of a `Scheduler` (read-only views of its queues and counts)."""

    config: SchedulerConfig
    kv: KVCacheManager

    @property
    def waiting_requests(self) -> Sequence[Request]: ...
    @property
    def running_requests(self) -> Sequence[Request]: ...
    @property
    def live_requests(self) -> Iterable[Request]: ...
    @property
    def num_prefilled(self) -> int: ...
    @property
    def num_awaiting_kv(self) -> int: ...
    @property
    def num_seated(self) -> int: ...
    def age(self, request: Request) -> tuple[float, int]: ...


_PINNED: frozenset[RequestStatus] = frozenset({RequestStatus.PREFILLED, RequestStatus.AWAITING_KV})


def check_scheduler_integrity(scheduler: SchedulerState) -> None:
    """Raise AssertionError naming the first request whose state and blocks disagree."""
    kv = scheduler.kv
    kv.check_integrity()
    for request in scheduler.waiting_requests:
        assert request.status is RequestStatus.WAITING, (
            f"{request.request_id} waits as {request.status}"
        )
        assert not kv.block_ids(request.request_id), f"waiting {request.request_id} owns blocks"
    for request in scheduler.running_requests:
        assert request.status is RequestStatus.RUNNING, (
            f"{request.request_id} runs as {request.status}"
        )
        num_blocks = len(kv.block_ids(request.request_id))
        assert num_blocks * kv.block_size >= request.num_computed_tokens, (
            f"running {request.request_id}: {num_blocks} blocks cannot hold "
            f"{request.num_computed_tokens} computed tokens"
        )
        assert request.num_computed_tokens < request.num_tokens, (
            f"running {request.request_id} has no token left to compute"
        )
    keys = [scheduler.age(r) for r in scheduler.running_requests]
    assert keys == sorted(keys), "running requests are not ordered by arrival"
    live = list(scheduler.live_requests)
    pinned = [r for r in live if r.status in _PINNED]
    assert len(pinned) == scheduler.num_prefilled + scheduler.num_awaiting_kv, (
        "pinned request count drifted"
    )
    for request in pinned:
        num_blocks = len(kv.block_ids(request.request_id))
        assert num_blocks == kv.num_blocks_for(request.num_prompt_tokens), (
            f"{request.status.name} {request.request_id} holds {num_blocks} blocks for "
            f"{request.num_prompt_tokens} prompt tokens"
        )
    assert all(not r.is_finished for r in live), "a finished request is live"
    assert scheduler.num_seated <= scheduler.config.max_num_seqs, (
        "more seated requests than max_num_seqs"
    )
