"""Continuous-batching scheduler: which requests compute how many tokens each step.

No prefill/decode phases: every step hands out a token budget and each request catches up
toward its length. Also holds the two disaggregation roles' extra states.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Sequence

from pdserve.engine.errors import InconsistentKVError, InvalidRequestError
from pdserve.engine.kv.manager import KVCacheManager
from pdserve.engine.prompt_allowance import PromptAllowance
from pdserve.engine.request import Request, RequestMode, RequestStatus
from pdserve.engine.request_checks import check_new_request, stop_status
from pdserve.engine.scheduler_integrity import check_scheduler_integrity
from pdserve.engine.scheduler_output import (
    ScheduledChunk,
    SchedulerConfig,
    SchedulerOutput,
)
from pdserve.engine.step_planning import BatchState, StepPlanner
from pdserve.engine.tiers.loads import TierLoads

logger = logging.getLogger(__name__)

__all__ = ["ScheduledChunk", "Scheduler", "SchedulerConfig", "SchedulerOutput", "stop_status"]


class Scheduler:
    """Owns every live request's state; the model runner only executes its plans.

    Lifecycle: WAITING -> RUNNING -> FINISHED_*; preemption (by recompute) sends RUNNING
    back to the front of WAITING. Prefill role: RUNNING -> PREFILLED (blocks pinned) ->
    `release`. Decode role: `reserve_for_received_kv` (AWAITING_KV) -> `activate_received`
    -> RUNNING. PREFILLED and AWAITING_KV requests are never scheduled or preempted; their
    blocks stay put until `release`/`activate_received`/`finish_request`, so the handoff
    may read or write them meanwhile. Finished requests are forgotten.

    Batch seats (``max_num_seqs``) are held by RUNNING, AWAITING_KV and LOADING_KV requests,
    so an activation never overfills the batch.

    With `loads` set, a waiting request whose prefix continues in the host tier may load it
    instead of computing it (LOADING_KV: its blocks filled by a copy, never scheduled) until
    `finish_load`; a failed load puts it back at the front of WAITING to compute instead.
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self._requests: dict[str, Request] = {}  # every live request, any status
        self._order: dict[str, tuple[float, int]] = {}  # (arrival_time, registration number)
        self._registrations = itertools.count()
        self._state = BatchState(self.age)
        self._planner = StepPlanner(config, kv_cache_manager, self._state)

    def schedule(self) -> SchedulerOutput:
        """Plan one step (engine/step_planning.py says how)."""
        return self._planner.schedule()

    def observe_step(self, output: SchedulerOutput, seconds: float) -> None:
        """How long the model took for a planned step (it paces the prompt allowance)."""
        self._planner.observe(output, seconds)

    @property
    def prompt_allowance(self) -> PromptAllowance:
        return self._planner.allowance

    @property
    def loads(self) -> TierLoads | None:
        """The tiers' loads, when the engine has tiers below the device."""
        return self._state.loads

    @loads.setter
    def loads(self, loads: TierLoads | None) -> None:
        self._state.loads = loads

    @property
    def num_admitted_tokens(self) -> int:
        """Cumulative tokens of admitted prompts (prefix-cache hit rate = hits / these)."""
        return self._state.num_admitted_tokens

    @property
    def num_prefix_hit_tokens(self) -> int:
        """Cumulative admitted tokens that came from the prefix cache or a tier."""
        return self._state.num_prefix_hit_tokens

    @property
    def num_loading(self) -> int:
        return self._state.num_loading

    @property
    def num_seated(self) -> int:
        """Requests holding a batch seat: RUNNING, AWAITING_KV and LOADING_KV ones."""
        return self._state.num_seated

    # ---- queries -------------------------------------------------------------------------

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    @property
    def num_waiting(self) -> int:
        return len(self._state.waiting)

    @property
    def num_running(self) -> int:
        return len(self._state.running)

    @property
    def num_awaiting_kv(self) -> int:
        return self._state.num_awaiting_kv

    @property
    def num_prefilled(self) -> int:
        return (len(self._requests) - len(self._state.waiting) - len(self._state.running)
                - self._state.num_awaiting_kv - self.num_loading)

    @property
    def has_unfinished_requests(self) -> bool:
        """Any live request at all, pinned (PREFILLED) and AWAITING_KV ones included."""
        return bool(self._requests)

    @property
    def has_schedulable_requests(self) -> bool:
        """Whether `schedule` can have work: some request is WAITING or RUNNING."""
        return bool(self._state.waiting or self._state.running)

    # ---- admission -----------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a FULL or PREFILL_ONLY request; raises if it is invalid or can never fit."""
        if request.mode is RequestMode.FROM_RECEIVED_KV:
            raise InvalidRequestError(
                f"request {request.request_id} expects received KV: use reserve_for_received_kv"
            )
        check_new_request(request, self.config, self.kv, self._requests)
        self._register(request)
        self._state.waiting.append(request)

    def reserve_for_received_kv(self, request: Request) -> list[int] | None:
        """Decode role: own blocks for the whole prompt now, to be filled by the handoff.

        A prefix already in this worker's cache is reused (``request.num_cached_tokens``
        says how many tokens, block-aligned): only the blocks after it need the KV sent.
        Returns those blocks' ids (position order) and marks the request AWAITING_KV, or
        returns None if there is no room right now (no free batch seat or not enough free
        blocks); nothing changed then and the caller may retry later or choose another
        worker. Raises like `add_request` for a request that is invalid or can never fit.
        """
        if request.mode is not RequestMode.FROM_RECEIVED_KV:
            raise InvalidRequestError(
                f"request {request.request_id} has mode {request.mode.name}; only "
                "FROM_RECEIVED_KV requests reserve blocks for received KV"
            )
        check_new_request(request, self.config, self.kv, self._requests)
        if self.num_seated >= self.config.max_num_seqs:
            return None
        cached_ids, num_cached = self.kv.find_cached_prefix(request)
        block_ids = self.kv.allocate_slots(request, request.num_prompt_tokens - num_cached,
                                           cached_ids)
        if block_ids is None:
            self.kv.free(request)
            return None
        request.num_cached_tokens = num_cached
        self._register(request)
        request.status = RequestStatus.AWAITING_KV
        self._state.num_awaiting_kv += 1
        return block_ids

    def activate_received(self, request_id: str, first_token_id: int) -> None:
        """Decode role: the prompt's KV arrived and was verified; start decoding.

        The prompt counts as computed and ``first_token_id`` (sampled by prefill) becomes
        output token 1. If it already ends the request (a stop token, max_tokens=1, the
        length limit) the request finishes here and its blocks are freed; check its status.
        Raises `InconsistentKVError`, changing nothing, unless the request's blocks cover
        exactly its prompt and it has no output yet: its KV and tokens would not be one
        computation's.
        """
        request = self._requests.get(request_id)
        if request is None or request.status is not RequestStatus.AWAITING_KV:
            state = "unknown" if request is None else request.status.name
            raise ValueError(
                f"activate_received({request_id!r}): request is {state}, not AWAITING_KV"
            )
        num_blocks = len(self.kv.block_ids(request_id))
        if request.output_token_ids or num_blocks != self.kv.num_blocks_for(
                request.num_prompt_tokens):
            raise InconsistentKVError(
                f"request {request_id} cannot continue from received KV: it holds {num_blocks} "
                f"blocks for {request.num_prompt_tokens} prompt tokens and already has "
                f"{len(request.output_token_ids)} output tokens")
        self._state.num_awaiting_kv -= 1
        request.num_computed_tokens = request.num_prompt_tokens
        self.kv.cache_full_blocks(request)
        request.output_token_ids.append(first_token_id)
        status = stop_status(request, first_token_id, self.config.max_model_len)
        if status is not None:
            self._finish(request, status)
            return
        self._state.run(request)

    # ---- the step's outcome ---------------------------------------------------------------

    def update_from_output(
        self, output: SchedulerOutput, sampled_token_ids: dict[str, int]
    ) -> list[Request]:
        """Record a finished step; returns the requests that got a token or finished.

        ``sampled_token_ids`` must hold a token for every sampling chunk. Requests finished
        externally while the step ran are skipped.
        """
        live = [c for c in output.chunks if c.request.status is RequestStatus.RUNNING]
        for chunk in live:
            request = chunk.request
            if request.num_computed_tokens != chunk.start_position:
                raise ValueError(
                    f"stale output for {request.request_id}: chunk starts at "
                    f"{chunk.start_position} but {request.num_computed_tokens} tokens are computed"
                )
            if chunk.samples and request.request_id not in sampled_token_ids:
                raise ValueError(f"no sampled token for {request.request_id}, whose chunk samples")
        changed: list[Request] = []
        for chunk in live:
            request = chunk.request
            request.num_computed_tokens += chunk.num_new_tokens
            self.kv.cache_full_blocks(request)
            if chunk.samples:
                self._append_sampled(request, sampled_token_ids[request.request_id])
                changed.append(request)
        if changed:
            self._state.running = [r for r in self._state.running
                                   if r.status is RequestStatus.RUNNING]
        return changed

    # ---- endings -------------------------------------------------------------------------

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """End a request from outside (stop string, abort, client gone) and free its blocks.

        No-op if the request is unknown or already finished. For PREFILLED and AWAITING_KV
        requests the caller must first make sure no transfer still reads or writes their
        blocks.
        """
        if not status.is_finished:
            raise ValueError(f"finish_request needs a FINISHED_* status, got {status.name}")
        request = self._requests.get(request_id)
        if request is None:
            return
        if request.status is RequestStatus.WAITING:
            self._state.waiting.remove(request)
        elif request.status is RequestStatus.RUNNING:
            self._state.running.remove(request)
        elif request.status is RequestStatus.AWAITING_KV:
            self._state.num_awaiting_kv -= 1
        elif request.status is RequestStatus.LOADING_KV:
            assert self.loads is not None
            self.loads.abort(request_id)  # its blocks are freed once the copy ended
            request.set_finished(status)
            del self._requests[request_id]
            del self._order[request_id]
            return
        self._finish(request, status)

    def finish_load(self, request_id: str, error: str | None, seconds: float) -> None:
        """The copy of a LOADING_KV request's prefix ended: it runs from the loaded prefix,
        or (``error``) computes it from the start of WAITING."""
        assert self.loads is not None
        finished = self.loads.finish(request_id, error, seconds)
        if finished is None:
            return
        request, loaded = finished
        if not loaded:
            self.kv.free(request)
            request.skip_tier_loads = True
            request.status = RequestStatus.WAITING
            self._state.waiting.appendleft(request)
            return
        self.kv.cache_full_blocks(request)
        self._state.num_admitted_tokens += request.num_tokens
        self._state.num_prefix_hit_tokens += request.num_computed_tokens
        if request.num_preemptions == 0:
            request.num_cached_tokens = request.num_computed_tokens
        self._state.run(request)

    def release(self, request_id: str) -> None:
        """Prefill role: every send of a PREFILLED request's blocks completed; unpin them.

        Full blocks stay in the prefix cache. The request is forgotten (status becomes
        FINISHED_STOPPED). No-op if unknown (already released or aborted).
        """
        request = self._requests.get(request_id)
        if request is None:
            return
        if request.status is not RequestStatus.PREFILLED:
            raise ValueError(
                f"release({request_id!r}): request is {request.status.name}, not PREFILLED; "
                "use finish_request to abort it"
            )
        self._finish(request, RequestStatus.FINISHED_STOPPED)

    def check_integrity(self) -> None:
        """Raise AssertionError unless request states and block ownership agree."""
        check_scheduler_integrity(self)

    @property
    def waiting_requests(self) -> Sequence[Request]:
        """WAITING requests in admission order (read only)."""
        return self._state.waiting

    @property
    def running_requests(self) -> Sequence[Request]:
        """RUNNING requests, oldest first (read only)."""
        return self._state.running

    @property
    def live_requests(self) -> Iterable[Request]:
        """Every live request, any status (read only)."""
        return self._requests.values()

    def age(self, request: Request) -> tuple[float, int]:
        """Sort key: arrival time, then registration order."""
        return self._order[request.request_id]

    # ---- internals -----------------------------------------------------------------------

    def _register(self, request: Request) -> None:
        self._requests[request.request_id] = request
        self._order[request.request_id] = (request.arrival_time, next(self._registrations))

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Free the request's blocks and forget it; the caller removed it from its queue."""
        self.kv.free(request)
        request.set_finished(status)
        del self._requests[request.request_id]
        del self._order[request.request_id]

    def _append_sampled(self, request: Request, token_id: int) -> None:
        request.output_token_ids.append(token_id)
        if request.mode is RequestMode.PREFILL_ONLY:
            request.status = RequestStatus.PREFILLED  # keeps its blocks until release()
            return
        status = stop_status(request, token_id, self.config.max_model_len)
        if status is not None:
            self._finish(request, status)
