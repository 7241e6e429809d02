"""Scheduler tests of the disaggregated roles with a model-free runner: a prefill-only request
keeps its blocks until released, KV received into reserved blocks activates a decode request,
and both roles together reproduce the colocated tokens."""

from __future__ import annotations

import pytest

from pdserve.engine.request import Request, RequestMode, RequestStatus
from tests.engine.scheduler_driver import (
    EOS,
    FakeRunner,
    is_finished_with,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
)


def test_prefill_only_keeps_blocks_pinned_until_release() -> None:
    sched, runner = make_scheduler(num_blocks=16, block_size=4)
    request = make_request("p", range(10), mode=RequestMode.PREFILL_ONLY)
    sched.add_request(request)
    _, changed = step(sched, runner)
    assert changed == [request] and request.status is RequestStatus.PREFILLED
    assert request.num_output_tokens == 1 and request.num_computed_tokens == 10
    pinned = sched.kv.block_ids("p")
    assert len(pinned) == 3 and sched.kv.num_free_blocks == 13
    for _ in range(3):  # never scheduled again, never preempted, blocks stay
        assert step(sched, runner)[0].is_empty
    assert sched.kv.block_ids("p") == pinned and sched.num_prefilled == 1
    assert sched.has_unfinished_requests and not sched.has_schedulable_requests
    sched.release("p")
    assert sched.get_request("p") is None and request.is_finished
    assert sched.kv.num_free_blocks == 16 and sched.kv.num_cached_blocks == 2
    sched.release("p")  # idempotent
    sched.check_integrity()


def test_release_of_a_request_that_is_not_prefilled_is_refused() -> None:
    sched, _ = make_scheduler()
    sched.add_request(make_request("a", range(4)))
    with pytest.raises(ValueError, match="WAITING, not PREFILLED"):
        sched.release("a")


def test_disaggregated_roles_reproduce_the_colocated_tokens() -> None:
    prompt = list(range(3, 17))
    colocated = make_request("r", prompt, max_tokens=6)
    sched, runner = make_scheduler(block_size=4)
    run_to_completion(sched, runner, [colocated])

    prefill_sched, prefill_runner = make_scheduler(block_size=4)
    on_prefill = make_request("r", prompt, mode=RequestMode.PREFILL_ONLY)
    prefill_sched.add_request(on_prefill)
    step(prefill_sched, prefill_runner)
    [first_token] = on_prefill.output_token_ids

    decode_sched, decode_runner = make_scheduler(block_size=4)
    on_decode = make_request("r", prompt, max_tokens=6, mode=RequestMode.FROM_RECEIVED_KV)
    block_ids = decode_sched.reserve_for_received_kv(on_decode)
    assert block_ids is not None and len(block_ids) == 4
    assert on_decode.status is RequestStatus.AWAITING_KV
    assert step(decode_sched, decode_runner)[0].is_empty  # not scheduled while awaiting
    _receive_kv(prefill_runner, decode_runner, on_prefill, on_decode)
    prefill_sched.release("r")
    decode_sched.activate_received("r", first_token)
    output, _ = step(decode_sched, decode_runner)
    assert [(c.start_position, c.num_new_tokens, c.samples) for c in output.chunks] == [
        (14, 1, True)
    ]
    run_to_completion(decode_sched, decode_runner, [])
    assert on_decode.output_token_ids == colocated.output_token_ids
    assert decode_sched.kv.num_free_blocks == decode_sched.kv.num_blocks
    assert prefill_sched.kv.num_free_blocks == prefill_sched.kv.num_blocks


def _receive_kv(src: FakeRunner, dst: FakeRunner, src_req: Request, dst_req: Request) -> None:
    """Copy the prompt's simulated KV block by block, as the handoff would."""
    bs = src.kv.block_size
    src_blocks, dst_blocks = (
        src.kv.block_ids(src_req.request_id),
        dst.kv.block_ids(dst_req.request_id),
    )
    for pos in range(src_req.num_prompt_tokens):
        dst.slots[(dst_blocks[pos // bs], pos % bs)] = src.slots[(src_blocks[pos // bs], pos % bs)]


@pytest.mark.parametrize(
    "max_tokens, first_token, status",
    [
        (1, 7, RequestStatus.FINISHED_LENGTH),
        (5, EOS, RequestStatus.FINISHED_STOPPED),
    ],
)
def test_activation_applies_stop_rules_to_the_first_token(
    max_tokens: int, first_token: int, status: RequestStatus
) -> None:
    sched, _ = make_scheduler()
    request = make_request(
        "r", range(6), max_tokens=max_tokens, ignore_eos=False, mode=RequestMode.FROM_RECEIVED_KV
    )
    assert sched.reserve_for_received_kv(request) is not None
    sched.activate_received("r", first_token)
    assert is_finished_with(request, status) and request.output_token_ids == [first_token]
    assert sched.kv.num_free_blocks == sched.kv.num_blocks and sched.get_request("r") is None
    with pytest.raises(ValueError, match="unknown, not AWAITING_KV"):
        sched.activate_received("r", 1)


def test_reserve_returns_none_without_room_and_changes_nothing() -> None:
    sched, _ = make_scheduler(num_blocks=5, block_size=4, max_num_seqs=2)
    received = RequestMode.FROM_RECEIVED_KV
    big = make_request("big", range(12), max_tokens=1, mode=received)
    assert sched.reserve_for_received_kv(big) is not None
    no_blocks = make_request("nb", range(12), max_tokens=1, mode=received)
    assert sched.reserve_for_received_kv(no_blocks) is None
    assert sched.get_request("nb") is None and sched.kv.num_free_blocks == 2
    small = make_request("s", range(3), max_tokens=1, mode=received)
    assert sched.reserve_for_received_kv(small) is not None
    sched.finish_request("s", RequestStatus.FINISHED_ABORTED)
    sched.add_request(make_request("seat", range(2), max_tokens=2))
    step(sched, FakeRunner(sched.kv))  # "seat" runs: 2 seats taken (big awaits)
    assert sched.kv.num_free_blocks == 1
    no_seat = make_request("ns", range(2), max_tokens=1, mode=received)
    assert sched.reserve_for_received_kv(no_seat) is None
    sched.check_integrity()
