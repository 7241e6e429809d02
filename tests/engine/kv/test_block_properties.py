"""Stateful property tests: random operation sequences against the block pool and scheduler.

The pool is checked against a small reference model (exact eviction order); the scheduler
against its invariants plus simulated KV contents read back on every sampled token.
"""

from __future__ import annotations

from hypothesis import HealthCheck, assume, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pdserve.engine.errors import OutOfKVBlocksError, PromptTooLongError
from pdserve.engine.kv.block_hash import hash_block
from pdserve.engine.kv.block_pool import BlockPool, NoFreeBlocksError
from pdserve.engine.request import Request, RequestMode, RequestStatus
from pdserve.engine.scheduler import Scheduler
from tests.engine.scheduler_driver import FakeRunner, make_request, make_scheduler

NUM_POOL_BLOCKS = 6
MAX_MODEL_LEN = 40
# Shared prompt stems make prefix hits (and their evictions) common.
STEMS = ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [20, 21, 22, 23, 24, 25])


def _tokens(content: int) -> list[int]:
    return [content] * 4


class BlockPoolMachine(RuleBasedStateMachine):
    """BlockPool vs. a list-based model of refcounts, free order and the cache map."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_POOL_BLOCKS, enable_prefix_caching=True)
        self.refs = [0] * NUM_POOL_BLOCKS
        self.free_order = list(range(NUM_POOL_BLOCKS))  # head first
        self.hash_of: dict[int, bytes] = {}
        self.cached: dict[bytes, tuple[int, int]] = {}  # hash -> (block, content)

    @rule(n=st.integers(0, NUM_POOL_BLOCKS + 1))
    def allocate(self, n: int) -> None:
        if n > len(self.free_order):
            try:
                self.pool.allocate(n)
            except NoFreeBlocksError:
                return
            raise AssertionError("allocate beyond the free blocks did not raise")
        expected, self.free_order = self.free_order[:n], self.free_order[n:]
        for block in expected:
            assert self.refs[block] == 0, "eviction of a referenced block"
            if block in self.hash_of:
                del self.cached[self.hash_of.pop(block)]
            self.refs[block] = 1
        assert self.pool.allocate(n) == expected

    @rule(block=st.integers(0, NUM_POOL_BLOCKS - 1))
    def touch(self, block: int) -> None:
        if self.refs[block] == 0:
            self.free_order.remove(block)
        self.refs[block] += 1
        self.pool.touch([block])

    @rule(block=st.integers(0, NUM_POOL_BLOCKS - 1))
    def release(self, block: int) -> None:
        assume(self.refs[block] > 0)
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.hash_of:
                self.free_order.append(block)
            else:
                self.free_order.insert(0, block)
        self.pool.release([block])

    @rule(block=st.integers(0, NUM_POOL_BLOCKS - 1), content=st.integers(0, 4))
    def cache(self, block: int, content: int) -> None:
        assume(self.refs[block] > 0 and block not in self.hash_of)
        block_hash = hash_block(None, _tokens(content), "m")
        expected = block_hash not in self.cached
        if expected:
            self.cached[block_hash] = (block, content)
            self.hash_of[block] = block_hash
        assert self.pool.cache_block(block, block_hash, _tokens(content)) is expected

    @rule(content=st.integers(0, 4), forged=st.booleans())
    def lookup(self, content: int, forged: bool) -> None:
        block_hash = hash_block(None, _tokens(content), "m")
        tokens = _tokens(content)[:3] + [99] if forged else _tokens(content)
        entry = self.cached.get(block_hash)
        expected = entry[0] if entry is not None and not forged else None
        assert self.pool.lookup(block_hash, tokens) == expected

    @invariant()
    def matches_model(self) -> None:
        self.pool.check_integrity()
        assert [self.pool.ref_count(b) for b in range(NUM_POOL_BLOCKS)] == self.refs
        assert self.pool.num_free_blocks == len(self.free_order)
        assert self.pool.num_cached_blocks == len(self.cached)


class SchedulerMachine(RuleBasedStateMachine):
    """Random traffic of all three modes under KV pressure; checks ownership every step."""

    def __init__(self) -> None:
        super().__init__()
        self.sched: Scheduler
        self.runner: FakeRunner
        self.next_id = 0

    @initialize(
        num_blocks=st.integers(5, 16),
        block_size=st.integers(2, 4),
        budget=st.integers(3, 32),
        max_num_seqs=st.integers(1, 5),
        threshold=st.sampled_from([0, 0, 3, 7]),
        caching=st.booleans(),
    )
    def setup(
        self,
        num_blocks: int,
        block_size: int,
        budget: int,
        max_num_seqs: int,
        threshold: int,
        caching: bool,
    ) -> None:
        self.sched, self.runner = make_scheduler(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            max_model_len=MAX_MODEL_LEN,
            long_prefill_token_threshold=threshold,
            enable_prefix_caching=caching,
        )

    def _new_request(self, data: st.DataObject, mode: RequestMode, min_tokens: int = 1) -> Request:
        stem = data.draw(st.sampled_from(STEMS))
        cut = data.draw(st.integers(0, len(stem)))
        suffix = data.draw(st.lists(st.integers(0, 49), max_size=14))
        prompt = (stem[:cut] + suffix) or [7]
        self.next_id += 1
        return make_request(
            f"r{self.next_id}",
            prompt,
            max_tokens=data.draw(st.integers(min_tokens, 24)),
            ignore_eos=data.draw(st.booleans()),
            mode=mode,
        )

    def _ids(self, *statuses: RequestStatus) -> list[str]:
        return sorted(rid for rid, r in self.sched._requests.items() if r.status in statuses)

    def _expect_refusal(self, request: Request, error: Exception) -> None:
        if isinstance(error, PromptTooLongError):
            assert request.num_prompt_tokens >= MAX_MODEL_LEN
        else:
            assert isinstance(error, OutOfKVBlocksError)
            assert request.num_prompt_tokens + request.sampling_params.max_tokens - 1 > (
                self.sched.kv.num_blocks * self.sched.kv.block_size
            )

    @precondition(lambda self: len(self.sched._requests) < 6)
    @rule(data=st.data(), prefill_only=st.booleans())
    def add(self, data: st.DataObject, prefill_only: bool) -> None:
        request = self._new_request(
            data, RequestMode.PREFILL_ONLY if prefill_only else RequestMode.FULL
        )
        try:
            self.sched.add_request(request)
        except (PromptTooLongError, OutOfKVBlocksError) as error:
            self._expect_refusal(request, error)

    @precondition(lambda self: len(self.sched._requests) < 6)
    @rule(data=st.data())
    def burst(self, data: st.DataObject) -> None:
        """Several long generations at once: the usual way into preemption."""
        for _ in range(3):
            request = self._new_request(data, RequestMode.FULL, min_tokens=10)
            try:
                self.sched.add_request(request)
            except (PromptTooLongError, OutOfKVBlocksError) as error:
                self._expect_refusal(request, error)

    @precondition(lambda self: self.sched.num_awaiting_kv < 2)
    @rule(data=st.data())
    def reserve_received(self, data: st.DataObject) -> None:
        request = self._new_request(data, RequestMode.FROM_RECEIVED_KV)
        free_before = self.sched.kv.num_free_blocks
        try:
            block_ids = self.sched.reserve_for_received_kv(request)
        except (PromptTooLongError, OutOfKVBlocksError) as error:
            self._expect_refusal(request, error)
            return
        if block_ids is None:
            assert self.sched.get_request(request.request_id) is None
            assert self.sched.kv.num_free_blocks == free_before
        else:  # a cached prefix is reused: only the blocks after it are to be received
            cached = request.num_cached_tokens
            assert cached % self.sched.kv.block_size == 0 and cached < request.num_prompt_tokens
            assert len(block_ids) == self.sched.kv.num_blocks_for(request.num_prompt_tokens) - (
                cached // self.sched.kv.block_size)

    @precondition(lambda self: self.sched.num_awaiting_kv > 0)
    @rule(data=st.data())
    def activate(self, data: st.DataObject) -> None:
        awaiting = self._ids(RequestStatus.AWAITING_KV)
        request = self.sched._requests[data.draw(st.sampled_from(awaiting))]
        # The handoff writes only after the reused prefix; next_token then reads all of it.
        self.runner.write_kv(request, request.num_cached_tokens, request.num_prompt_tokens)
        first = self.runner.next_token(request, request.num_prompt_tokens)
        self.sched.activate_received(request.request_id, first)

    @precondition(lambda self: self.sched.has_unfinished_requests)
    @rule(
        data=st.data(),
        status=st.sampled_from([RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_STOPPED]),
    )
    def finish(self, data: st.DataObject, status: RequestStatus) -> None:
        live = sorted(self.sched._requests)
        request_id = data.draw(st.sampled_from(live))
        request = self.sched._requests[request_id]
        self.sched.finish_request(request_id, status)
        assert request.status is status and self.sched.get_request(request_id) is None

    @precondition(lambda self: self.sched.num_prefilled > 0)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        prefilled = self._ids(RequestStatus.PREFILLED)
        self.sched.release(data.draw(st.sampled_from(prefilled)))

    @rule(num_steps=st.integers(1, 8))
    def step(self, num_steps: int) -> None:
        for _ in range(num_steps):
            self._checked_step()

    def _checked_step(self) -> None:
        owned_before = {rid: set(self.sched.kv.block_ids(rid)) for rid in self.sched._requests}
        seated_before = set(self._ids(RequestStatus.RUNNING, RequestStatus.AWAITING_KV))
        output = self.sched.schedule()
        config = self.sched.config
        assert output.num_batched_tokens == sum(c.num_new_tokens for c in output.chunks)
        assert output.num_batched_tokens <= config.max_num_batched_tokens
        assert len({c.request.request_id for c in output.chunks}) == len(output.chunks)
        assert len(seated_before | {c.request.request_id for c in output.chunks}) <= (
            config.max_num_seqs + len(output.preempted_request_ids)
        )
        for chunk in output.chunks:
            rid = chunk.request.request_id
            if config.long_prefill_token_threshold:
                assert chunk.num_new_tokens <= config.long_prefill_token_threshold
            block_ids = self.sched.kv.block_ids(rid)
            gained = set(block_ids) - owned_before.get(rid, set())
            if not owned_before.get(rid):  # admitted now: its leading blocks may be prefix hits
                gained -= set(block_ids[: chunk.start_position // self.sched.kv.block_size])
            for other, blocks in owned_before.items():
                if other != rid and other not in output.preempted_request_ids:
                    assert not gained & blocks, (
                        f"{rid} was given blocks {gained & blocks} of {other}"
                    )
        self.sched.check_integrity()
        self.sched.update_from_output(output, self.runner.execute(output))

    @rule()
    def drain(self) -> None:
        """Unpin everything, then every request must complete (preempted ones included)."""
        for rid in self._ids(RequestStatus.PREFILLED):
            self.sched.release(rid)
        for rid in self._ids(RequestStatus.AWAITING_KV):
            self.sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)
        for _ in range(2_000):
            if not self.sched.has_schedulable_requests:
                break
            self._checked_step()
            for rid in self._ids(RequestStatus.PREFILLED):
                self.sched.release(rid)
        assert not self.sched.has_unfinished_requests, "requests starved with no pinned blocks"

    @invariant()
    def integrity(self) -> None:
        if not hasattr(self, "sched"):
            return
        self.sched.check_integrity()
        if not self.sched.has_unfinished_requests:
            assert self.sched.kv.num_free_blocks == self.sched.kv.num_blocks

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        for rid in list(self.sched._requests):
            self.sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)
        self.sched.check_integrity()
        assert self.sched.kv.num_free_blocks == self.sched.kv.num_blocks


_SETTINGS = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = _SETTINGS
TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = _SETTINGS
