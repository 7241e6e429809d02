"""Scheduler tests with a model-free runner: budgets, chunking, prefix hits, preemption, order.

Tokens come from a fake runner that reads every position's simulated KV back, so a test
that compares tokens also checks that the right KV was in the right blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from pdserve.engine.errors import InvalidRequestError, OutOfKVBlocksError, PromptTooLongError
from pdserve.engine.request import Request, RequestMode, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from tests.engine.scheduler_driver import (
    EOS,
    is_finished_with,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
)


def _outputs(requests: Sequence[Request]) -> dict[str, list[int]]:
    return {r.request_id: list(r.output_token_ids) for r in requests}


def test_token_budget_and_seat_limit_are_respected() -> None:
    sched, runner = make_scheduler(max_num_batched_tokens=16, max_num_seqs=3)
    requests = [make_request(f"r{i}", range(i, i + 11), max_tokens=5) for i in range(6)]
    outputs = run_to_completion(sched, runner, requests)
    for out in outputs:
        assert out.num_batched_tokens == sum(c.num_new_tokens for c in out.chunks) <= 16
        assert len(out.chunks) <= 3
    assert all(is_finished_with(r, RequestStatus.FINISHED_LENGTH) for r in requests)
    assert all(r.num_output_tokens == 5 for r in requests)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_chunked_prefill_splits_mid_block_and_samples_only_on_the_last_chunk() -> None:
    sched, runner = make_scheduler(block_size=4, max_num_batched_tokens=6)
    request = make_request("a", range(14), max_tokens=2)
    sched.add_request(request)
    plan = []
    for _ in range(3):
        output, _ = step(sched, runner)
        [chunk] = output.chunks
        plan.append((chunk.start_position, chunk.num_new_tokens, chunk.samples))
    assert plan == [(0, 6, False), (6, 6, False), (12, 2, True)]
    assert request.num_output_tokens == 1
    output, _ = step(sched, runner)
    assert [(c.start_position, c.num_new_tokens, c.samples) for c in output.chunks] == [
        (14, 1, True)
    ]
    assert request.is_finished


def test_long_prefill_threshold_caps_each_chunk_and_decodes_keep_going() -> None:
    sched, runner = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=5)
    decoding = make_request("d", range(3), max_tokens=20)
    sched.add_request(decoding)
    step(sched, runner)
    sched.add_request(make_request("long", range(100, 120), max_tokens=1))
    output, _ = step(sched, runner)
    sizes = {c.request.request_id: c.num_new_tokens for c in output.chunks}
    assert sizes == {"d": 1, "long": 5}


def test_prefix_hit_computes_only_the_suffix() -> None:
    sched, runner = make_scheduler(block_size=4)
    first = make_request("first", range(12), max_tokens=1)
    run_to_completion(sched, runner, [first])
    second = make_request("second", list(range(8)) + [40, 41, 42, 43, 44], max_tokens=3)
    sched.add_request(second)
    output, _ = step(sched, runner)
    [chunk] = output.chunks
    assert second.num_cached_tokens == 8
    assert (chunk.start_position, chunk.num_new_tokens) == (8, 5)
    run_to_completion(sched, runner, [])
    # The same request on a cold cache produces the same tokens (the hit KV was right).
    cold_sched, cold_runner = make_scheduler(block_size=4)
    cold = make_request("second", list(range(8)) + [40, 41, 42, 43, 44], max_tokens=3)
    run_to_completion(cold_sched, cold_runner, [cold])
    assert cold.num_cached_tokens == 0 and cold.output_token_ids == second.output_token_ids
    assert (sched.num_admitted_tokens, sched.num_prefix_hit_tokens) == (12 + 13, 8)


def test_identical_prompt_still_computes_its_last_token() -> None:
    sched, runner = make_scheduler(block_size=4)
    run_to_completion(sched, runner, [make_request("a", range(8), max_tokens=1)])
    again = make_request("b", range(8), max_tokens=1)
    sched.add_request(again)
    output, _ = step(sched, runner)
    assert again.num_cached_tokens == 4
    assert [(c.start_position, c.num_new_tokens, c.samples) for c in output.chunks] == [
        (4, 4, True)
    ]


def _pressure_run(num_blocks: int) -> tuple[Scheduler, list[Request], int]:
    sched, runner = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=32)
    requests = [
        make_request(f"r{i}", [i * 10 + j for j in range(9)], max_tokens=14, arrival_time=float(i))
        for i in range(4)
    ]
    outputs = run_to_completion(sched, runner, requests)
    preempted = [rid for out in outputs for rid in out.preempted_request_ids]
    return sched, requests, len(preempted)


def test_preemption_under_kv_pressure_recomputes_to_the_same_tokens() -> None:
    _, relaxed, num_relaxed = _pressure_run(num_blocks=64)
    sched, tight, num_tight = _pressure_run(num_blocks=12)
    assert num_relaxed == 0 and num_tight > 0
    assert any(r.num_preemptions > 0 for r in tight)
    assert _outputs(tight) == _outputs(relaxed)
    assert all(r.num_output_tokens == 14 for r in tight)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    sched.check_integrity()


def test_the_youngest_running_request_is_preempted_and_requeued_first() -> None:
    sched, runner = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    old = make_request("old", range(8), max_tokens=14, arrival_time=1.0)
    young = make_request("young", range(100, 108), max_tokens=14, arrival_time=2.0)
    sched.add_request(young)  # queued first, but arrived later
    sched.add_request(old)
    for _ in range(20):
        output, _ = step(sched, runner)
        if output.preempted_request_ids:
            break
    assert output.preempted_request_ids == ["young"]
    assert young.status is RequestStatus.WAITING and young.num_computed_tokens == 0
    assert young.num_preemptions == 1 and old.status is RequestStatus.RUNNING
    assert sched.kv.block_ids("young") == []
    assert [c.request.request_id for c in output.chunks] == ["old"]


def test_prompt_too_long_names_both_numbers() -> None:
    sched, _ = make_scheduler(max_model_len=32)
    with pytest.raises(PromptTooLongError, match=r"32 tokens.*32 tokens") as info:
        sched.add_request(make_request("a", range(32)))
    assert (info.value.num_prompt_tokens, info.value.max_model_len) == (32, 32)
    sched.add_request(make_request("b", range(31)))  # one token of room is enough


def test_request_that_can_never_fit_is_refused() -> None:
    sched, _ = make_scheduler(num_blocks=4, block_size=4)
    with pytest.raises(OutOfKVBlocksError, match="needs up to 5 KV blocks"):
        sched.add_request(make_request("a", range(10), max_tokens=10))
    sched.add_request(make_request("b", range(10), max_tokens=7))  # 16 KV tokens: 4 blocks


def test_duplicate_ids_and_wrong_modes_are_refused() -> None:
    sched, _ = make_scheduler()
    sched.add_request(make_request("a", range(4)))
    with pytest.raises(InvalidRequestError, match="already in use"):
        sched.add_request(make_request("a", range(4)))
    with pytest.raises(InvalidRequestError, match="reserve_for_received_kv"):
        sched.add_request(make_request("b", range(4), mode=RequestMode.FROM_RECEIVED_KV))
    with pytest.raises(InvalidRequestError, match="only FROM_RECEIVED_KV"):
        sched.reserve_for_received_kv(make_request("c", range(4)))


def test_stop_rules() -> None:
    sched, runner = make_scheduler(max_model_len=20)
    free_run = make_request("free", range(5), max_tokens=200)
    run_to_completion(sched, runner, [free_run])
    assert is_finished_with(free_run, RequestStatus.FINISHED_LENGTH)
    assert free_run.num_tokens == 20  # stopped at max_model_len, not max_tokens
    tokens = free_run.output_token_ids  # the runner is deterministic: same prompt, same tokens
    stop_at = tokens.index(tokens[3]) + 1

    def rerun(request_id: str, eos: int, **kwargs: Any) -> Request:
        params = SamplingParams(max_tokens=kwargs.pop("max_tokens", 200), temperature=0, **kwargs)
        request = Request(request_id, list(range(5)), params, (eos,))
        run_to_completion(sched, runner, [request])
        return request

    by_eos = rerun("eos", tokens[3])
    assert is_finished_with(by_eos, RequestStatus.FINISHED_STOPPED)
    assert by_eos.output_token_ids == tokens[:stop_at]
    ignored = rerun("ignored", tokens[3], ignore_eos=True)
    assert ignored.output_token_ids == tokens
    by_id = rerun("stop-id", EOS, ignore_eos=True, stop_token_ids=(tokens[3],))
    assert is_finished_with(by_id, RequestStatus.FINISHED_STOPPED)
    assert by_id.output_token_ids == tokens[:stop_at]
    by_length = rerun("length", EOS, ignore_eos=True, max_tokens=4)
    assert is_finished_with(by_length, RequestStatus.FINISHED_LENGTH)
    assert by_length.output_token_ids == tokens[:4]
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_finish_request_frees_blocks_in_every_state() -> None:
    sched, runner = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    running = make_request("running", range(6), max_tokens=50)
    prefilled = make_request("prefilled", range(100, 106), mode=RequestMode.PREFILL_ONLY)
    waiting = make_request("waiting", range(200, 220))
    for r in (running, prefilled, waiting):
        sched.add_request(r)
    for _ in range(3):
        step(sched, runner)
    awaiting = make_request("awaiting", range(300, 310), mode=RequestMode.FROM_RECEIVED_KV)
    assert sched.reserve_for_received_kv(awaiting) is not None
    assert prefilled.status is RequestStatus.PREFILLED and running.status is RequestStatus.RUNNING
    for r in (running, prefilled, waiting, awaiting):
        sched.finish_request(r.request_id, RequestStatus.FINISHED_ABORTED)
        assert is_finished_with(r, RequestStatus.FINISHED_ABORTED)
        sched.check_integrity()
    sched.finish_request("running", RequestStatus.FINISHED_ABORTED)  # unknown now: no-op
    assert not sched.has_unfinished_requests
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    with pytest.raises(ValueError, match="FINISHED_"):
        sched.finish_request("x", RequestStatus.RUNNING)


def test_abort_during_a_step_is_skipped_by_update() -> None:
    sched, runner = make_scheduler()
    a, b = make_request("a", range(5)), make_request("b", range(10, 15))
    sched.add_request(a)
    sched.add_request(b)
    output = sched.schedule()
    sampled = runner.execute(output)
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED)  # the client left mid-step
    changed = sched.update_from_output(output, sampled)
    assert changed == [b] and a.num_output_tokens == 0 and b.num_output_tokens == 1
    sched.check_integrity()


def test_update_refuses_inconsistent_output() -> None:
    sched, runner = make_scheduler()
    sched.add_request(make_request("a", range(5)))
    output = sched.schedule()
    with pytest.raises(ValueError, match="no sampled token for a"):
        sched.update_from_output(output, {})
    sampled = runner.execute(output)
    sched.update_from_output(output, sampled)
    with pytest.raises(ValueError, match="stale output"):
        sched.update_from_output(output, sampled)


def test_waiting_queue_is_first_come_first_served() -> None:
    sched, runner = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=64)
    hog = make_request("hog", range(24), max_tokens=8)  # 6 blocks, up to 8 while decoding
    big = make_request("big", range(100, 112), max_tokens=1)  # needs 3 blocks: must wait
    small = make_request("small", [200], max_tokens=1)  # would fit, but queued behind "big"
    for r in (hog, big, small):
        sched.add_request(r)
    output, _ = step(sched, runner)
    assert [c.request.request_id for c in output.chunks] == ["hog"]
    assert sched.num_waiting == 2


def _chunk_sizes(output: Any) -> dict[str, int]:
    return {c.request.request_id: c.num_new_tokens for c in output.chunks}


def test_a_short_prompt_is_not_held_behind_a_long_prompts_chunks() -> None:
    sched, runner = make_scheduler(num_blocks=128, block_size=4, max_num_batched_tokens=32,
                                   max_model_len=512)
    long = make_request("long", range(100, 300), max_tokens=2)  # 200 tokens: 7 chunks of 32
    sched.add_request(long)
    first, _ = step(sched, runner)
    assert _chunk_sizes(first) == {"long": 32}
    short = make_request("short", range(10), max_tokens=20)
    sched.add_request(short)  # arrives one step after the long one
    sizes: list[dict[str, int]] = []
    while long.num_output_tokens == 0:
        output, _ = step(sched, runner)
        sizes.append(_chunk_sizes(output))
        # The long prompt keeps at least half of every step's budget.
        assert sizes[-1]["long"] >= 16, sizes
    # The short prompt's prefill completed in the first step after its arrival, whole, and
    # it decoded in every later step while the long prompt's chunks ran.
    assert sizes[0]["short"] == 10 and short.num_output_tokens == len(sizes)
    assert all(s["short"] == 1 for s in sizes[1:])
    assert sum(s["long"] for s in sizes) == 200 - 32
    run_to_completion(sched, runner, [])
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_short_prompts_pass_a_waiting_long_one_but_long_ones_keep_their_order() -> None:
    sched, runner = make_scheduler(num_blocks=256, block_size=4, max_num_batched_tokens=32,
                                   max_model_len=512)
    first = make_request("first", range(100, 200), max_tokens=1)
    second = make_request("second", range(200, 300), max_tokens=1)
    short = make_request("short", range(5), max_tokens=1)
    sched.add_request(first)
    step(sched, runner)
    sched.add_request(second)
    sched.add_request(short)  # behind a waiting long prompt, while another one is mid-prefill
    output, _ = step(sched, runner)
    assert _chunk_sizes(output) == {"short": 5, "first": 27}
    assert short.is_finished and second.status is RequestStatus.WAITING
    admitted: list[str] = []
    while sched.has_unfinished_requests:
        output, _ = step(sched, runner)
        admitted += [c.request.request_id for c in output.chunks
                     if c.start_position == 0 and c.request.request_id not in admitted]
        if second.num_computed_tokens:
            assert first.num_output_tokens == 1  # the second long one started after the first
    assert admitted == ["second"]


def test_decodes_are_never_held_back_by_a_prompt_chunk() -> None:
    sched, runner = make_scheduler(num_blocks=128, block_size=4, max_num_batched_tokens=16,
                                   max_model_len=512)
    long = make_request("long", range(100, 200), max_tokens=1, arrival_time=1.0)
    young = make_request("young", range(5), max_tokens=12, arrival_time=2.0)
    sched.add_request(young)
    step(sched, runner)  # young decodes from here on
    sched.add_request(long)  # older, so first in the running order, and no chunk cap
    while not long.is_finished:
        output, _ = step(sched, runner)
        assert _chunk_sizes(output)["young"] == 1
        assert output.num_batched_tokens == 16 or long.num_output_tokens


def test_while_the_first_waiting_request_finds_no_blocks_nothing_overtakes_it() -> None:
    sched, runner = make_scheduler(num_blocks=10, block_size=4, max_num_batched_tokens=64,
                                   max_model_len=64)
    hog = make_request("hog", range(28), max_tokens=8)  # 7 blocks, 8 when it decodes
    sched.add_request(hog)
    step(sched, runner)
    big = make_request("big", range(100, 116), max_tokens=1)  # 4 blocks: not before hog ends
    small = make_request("small", [200, 201], max_tokens=1)  # 1 block would fit
    sched.add_request(big)
    sched.add_request(small)
    order: list[str] = []
    while sched.has_unfinished_requests:
        output, _ = step(sched, runner)
        order += [c.request.request_id for c in output.chunks if c.start_position == 0]
    assert order == ["big", "small"] and hog.num_output_tokens == 8
