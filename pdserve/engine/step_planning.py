"""How the scheduler plans one step: decodes first, then whole short prompts, then chunks of
running prompts, then more waiting prompts; preemption by recompute when blocks run out.
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.engine.kv.manager import KVCacheManager
from pdserve.engine.prompt_allowance import PromptAllowance
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler_output import (
    ScheduledChunk,
    SchedulerConfig,
    SchedulerOutput,
    StepPlan,
)
from pdserve.engine.tiers.loads import TierLoads

logger = logging.getLogger(__name__)


@dataclass
class BatchState:
    """What the scheduler knows of its batch, shared by its lifecycle (engine/scheduler.py)
    and its step planner: the queues, the seats awaiting KV, the tiers' loads, counters."""

    age: Callable[[Request], tuple[float, int]]  # sort key of the running list
    waiting: deque[Request] = field(default_factory=deque)  # FCFS; preempted at the front
    running: list[Request] = field(default_factory=list)  # oldest first
    num_awaiting_kv: int = 0
    head_blocked: bool = False  # the first waiting request found no seat or blocks
    loads: TierLoads | None = None  # set when the engine has tiers below the device
    # Cumulative: tokens of admissions and how many came from the prefix cache.
    num_admitted_tokens: int = 0
    num_prefix_hit_tokens: int = 0

    @property
    def num_loading(self) -> int:
        return 0 if self.loads is None else len(self.loads.loading_requests())

    @property
    def num_seated(self) -> int:
        """Requests holding a batch seat: RUNNING, AWAITING_KV and LOADING_KV ones."""
        return len(self.running) + self.num_awaiting_kv + self.num_loading

    def run(self, request: Request) -> None:
        """Mark an admitted request RUNNING and seat it by age."""
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=self.age)


class StepPlanner:
    """Plans each step of the scheduler that holds it, over the batch state they share."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, state: BatchState) -> None:
        self.config = config
        self.kv = kv
        self.state = state
        self.allowance = PromptAllowance(config.decode_prompt_tokens_per_step,
                                         config.decode_step_bound_s, kv.block_size)

    def schedule(self) -> SchedulerOutput:
        """Plan one step. No request waits behind another's prompt chunks for long:

        1. every running request one token behind (decoding) gets it, oldest first;
        2. waiting prompts that fit whole into what is left join, first come first served,
           keeping half of it for step 3 while a running prompt is mid-prefill;
        3. each running prompt mid-prefill gets its next chunk, oldest first;
        4. more waiting prompts join, first come first served, the last one chunked.

        With rows decoding and the decode prompt cap on, step 2 admits only prompts within the
        cap, and steps 3-4 (chunks of longer prompts) share the prompt allowance, not the rest
        of the budget.
        """
        plan = StepPlan(self.config.max_num_batched_tokens)
        mid_prefill = self._schedule_decodes(plan)
        capped = self.allowance.enabled and bool(plan.chunks)
        # After a preemption the cache is full: admitting more would only thrash.
        if not plan.preempted_ids:
            self._admit_whole(plan, plan.budget - plan.budget // 2 if mid_prefill else plan.budget,
                              self.allowance.budget if capped else 0)
        withheld = 0
        if capped:
            withheld = max(0, plan.budget - self.allowance.tokens)
            plan.budget -= withheld
        self._schedule_chunks(plan, mid_prefill)
        if not plan.preempted_ids:
            self._schedule_waiting(plan)
        plan.budget += withheld
        return plan.output(self.config.max_num_batched_tokens)

    def observe(self, output: SchedulerOutput, seconds: float) -> None:
        """A planned step's measured time, for the prompt allowance."""
        num_decode_rows = sum(1 for c in output.chunks if c.num_new_tokens == 1
                              and c.end_position > c.request.num_prompt_tokens)
        self.allowance.observe(seconds, num_decode_rows,
                               output.num_batched_tokens - num_decode_rows)

    def _chunk_size(self, request: Request, num_computed: int, budget: int) -> int:
        num_new = min(request.num_tokens - num_computed, budget)
        cap = self.config.long_prefill_token_threshold
        return min(num_new, cap) if cap > 0 else num_new

    def _make_chunk(self, request: Request, num_new_tokens: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        return ScheduledChunk(
            request=request,
            num_new_tokens=num_new_tokens,
            start_position=start,
            samples=start + num_new_tokens == request.num_tokens,
        )

    def _schedule_decodes(self, plan: StepPlan) -> list[Request]:
        """Step 1; returns the running requests mid-prefill, oldest first, for step 3."""
        mid_prefill: list[Request] = []
        i = 0
        while i < len(self.state.running) and plan.budget > 0:
            request = self.state.running[i]
            if request.num_tokens - request.num_computed_tokens > 1:
                mid_prefill.append(request)
            elif self._allocate(plan, request, 1):
                plan.add(self._make_chunk(request, 1))
            else:
                return mid_prefill  # preempted itself: every younger request is gone too
            i += 1
        return mid_prefill

    def _schedule_chunks(self, plan: StepPlan, mid_prefill: list[Request]) -> None:
        """Step 3."""
        for request in mid_prefill:
            if plan.budget <= 0:
                return
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted meanwhile
            num_new = self._chunk_size(request, request.num_computed_tokens, plan.budget)
            if self._allocate(plan, request, num_new):
                plan.add(self._make_chunk(request, num_new))

    def _allocate(self, plan: StepPlan, request: Request, num_new: int) -> bool:
        """Blocks for ``num_new`` more tokens of a running request, preempting the youngest
        running requests not planned this step until they fit; False if that was itself."""
        while self.kv.allocate_slots(request, num_new) is None:
            victim = next(r for r in reversed(self.state.running)
                          if r.request_id not in plan.planned)
            self.state.running.remove(victim)
            self._preempt(victim)
            plan.preempted_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _admit_whole(self, plan: StepPlan, limit: int, longest: int) -> None:
        """Step 2: waiting prompts whose uncomputed tokens fit whole into ``limit`` (and each
        into ``longest``, 0: no such bound) join, FCFS, passing over longer ones (they keep
        their place for step 4)."""
        if self.state.head_blocked:
            return  # the head's turn: the blocks or seats these would take, it needs
        cap = min(self.config.long_prefill_token_threshold or limit, longest or limit)
        i = 0
        state = self.state
        while i < len(state.waiting) and limit > 0 and state.num_seated < self.config.max_num_seqs:
            request = self.state.waiting[i]
            cached_ids, num_cached = self.kv.find_cached_prefix(request)
            loading = self._start_load(request, cached_ids)
            if loading is not None:
                if not loading:
                    return
                del self.state.waiting[i]
                continue
            num_new = request.num_tokens - num_cached
            if num_new > min(limit, cap):
                i += 1  # long: it waits for step 4
                continue
            if not self._admit(plan, request, num_new, cached_ids, num_cached):
                return
            del self.state.waiting[i]
            limit -= num_new

    def _schedule_waiting(self, plan: StepPlan) -> None:
        """Step 4: waiting requests join FCFS, the last one with the chunk that fits."""
        # Strict FCFS on resources: while the head finds no seat or blocks, later requests
        # do not overtake it, not even in step 2.
        self.state.head_blocked = False
        while self.state.waiting and plan.budget > 0:
            request = self.state.waiting[0]
            cached_ids, num_cached = self.kv.find_cached_prefix(request)
            loading = (self._start_load(request, cached_ids)
                       if self.state.num_seated < self.config.max_num_seqs else None)
            if loading:
                self.state.waiting.popleft()
                continue
            num_new = self._chunk_size(request, num_cached, plan.budget)
            if (loading is False or self.state.num_seated >= self.config.max_num_seqs
                    or not self._admit(plan, request, num_new, cached_ids, num_cached)):
                self.state.head_blocked = True
                return
            self.state.waiting.popleft()

    def _start_load(self, request: Request, cached_ids: list[int]) -> bool | None:
        """Start loading the request's prefix from another tier when the cost model says so:
        True (it is LOADING_KV now), False (a load was chosen but its blocks do not fit),
        None (no load: compute)."""
        if self.state.loads is None:
            return None
        plan = self.state.loads.plan(request, len(cached_ids))
        if plan is None:
            return None
        return self.state.loads.start(request, cached_ids, plan)

    def _admit(self, plan: StepPlan, request: Request, num_new: int, cached_ids: list[int],
               num_cached: int) -> bool:
        """Start a waiting request with a chunk of ``num_new`` tokens (the caller dequeues it);
        False when its blocks do not fit (nothing changed)."""
        if self.kv.allocate_slots(request, num_new, cached_ids) is None:
            return False
        request.num_computed_tokens = num_cached
        self.state.num_admitted_tokens += request.num_tokens
        self.state.num_prefix_hit_tokens += num_cached
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_cached
        self.state.run(request)
        plan.add(self._make_chunk(request, num_new))
        return True

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.state.waiting.appendleft(request)
        logger.debug(
            "preempted %s (preemption %d), %d KV blocks free",
            request.request_id,
            request.num_preemptions,
            self.kv.num_free_blocks,
        )
