"""The decode prompt cap: what a step with decoding rows may prefill, paced by measured step
times, and the scheduler holding its steps to it."""

from __future__ import annotations

from pdserve.engine.prompt_allowance import PromptAllowance
from tests.engine.scheduler_driver import make_request, make_scheduler, step

BOUND_S = 0.04


def test_the_allowance_is_what_the_bound_leaves_at_the_measured_token_cost() -> None:
    allowance = PromptAllowance(256, BOUND_S, 16)
    assert allowance.tokens == 16  # nothing measured yet: one block
    allowance.observe(0.010, num_decode_rows=8, num_prompt_tokens=0)
    allowance.observe(0.030, num_decode_rows=8, num_prompt_tokens=64)  # 64 tokens add 20 ms
    # (40 - 10) ms left, 0.3125 ms a token: 96 tokens, whole blocks.
    assert allowance.tokens == 96
    assert allowance.token_us() == 312
    assert allowance.lend_tokens_per_s() == 2400  # 96 tokens a 40 ms step
    for _ in range(50):  # the decoding rows alone come to take 35 ms of the 40
        allowance.observe(0.035, num_decode_rows=40, num_prompt_tokens=0)
    assert allowance.tokens == 16
    assert allowance.lend_tokens_per_s() == 0  # one block a step is no room to lend
    for _ in range(50):  # past the bound: a prompt still moves, a block a step
        allowance.observe(0.060, num_decode_rows=64, num_prompt_tokens=0)
    assert allowance.tokens == 16
    for _ in range(50):  # prompt tokens turn cheap: never past the budget
        allowance.observe(0.005, num_decode_rows=1, num_prompt_tokens=0)
        allowance.observe(0.006, num_decode_rows=1, num_prompt_tokens=16)
    assert allowance.tokens == 256


def test_steps_without_decoding_rows_say_nothing_and_a_zero_budget_is_no_cap() -> None:
    allowance = PromptAllowance(256, BOUND_S, 16)
    allowance.observe(10 * BOUND_S, num_decode_rows=0, num_prompt_tokens=2048)  # prompts alone
    assert (allowance.decode_s, allowance.token_s, allowance.tokens) == (None, None, 16)
    assert (allowance.room(), allowance.lend_tokens_per_s(), allowance.token_us()) == (None, 0, 0)
    off = PromptAllowance(0, BOUND_S, 16)
    off.observe(0.01, num_decode_rows=4, num_prompt_tokens=0)
    off.observe(0.02, num_decode_rows=4, num_prompt_tokens=64)
    assert not off.enabled and off.tokens == 0


def _prompt_tokens(output) -> int:  # type: ignore[no-untyped-def]
    return sum(c.num_new_tokens for c in output.chunks
               if c.end_position <= c.request.num_prompt_tokens)


def test_a_long_prompt_among_decoding_rows_prefills_within_the_allowance() -> None:
    scheduler, runner = make_scheduler(num_blocks=256, block_size=16, max_num_batched_tokens=512,
                                       max_model_len=2048, decode_prompt_tokens_per_step=64,
                                       decode_step_bound_s=BOUND_S)
    for i in range(3):
        scheduler.add_request(make_request(f"s{i}", [1 + i] * 20, max_tokens=200))
    first, _ = step(scheduler, runner)
    assert _prompt_tokens(first) == 60  # nothing decodes yet: the whole budget is there
    decoding, _ = step(scheduler, runner)
    scheduler.observe_step(decoding, 0.010)  # three rows alone: 10 ms
    scheduler.add_request(make_request("long", list(range(1, 1001)), max_tokens=4))
    taken = []
    while scheduler.get_request("long").num_computed_tokens < 1000:
        output, _ = step(scheduler, runner)
        assert sum(1 for c in output.chunks if c.num_new_tokens == 1) == 3  # every row decodes
        taken.append(_prompt_tokens(output))
        # Each prompt token costs 1 ms: 30 ms of room is 30 tokens, one block of 16.
        scheduler.observe_step(output, 0.010 + 0.001 * taken[-1])
    assert taken[0] == 16 and max(taken) == 16  # one block until measured, then what fits
    scheduler.add_request(make_request("long2", list(range(2, 1002)), max_tokens=4))
    taken = []
    for _ in range(12):  # prompt tokens turn 10x cheaper: the budget caps what a step takes
        output, _ = step(scheduler, runner)
        taken.append(_prompt_tokens(output))
        scheduler.observe_step(output, 0.010 + 0.0001 * taken[-1])
    assert max(taken) == 64 and taken == sorted(taken)
    drain(scheduler, runner)


def test_without_a_cap_the_long_prompt_takes_what_the_step_has_left() -> None:
    scheduler, runner = make_scheduler(num_blocks=256, block_size=16, max_num_batched_tokens=512,
                                       max_model_len=2048)
    scheduler.add_request(make_request("s0", [1] * 20, max_tokens=200))
    step(scheduler, runner)
    scheduler.add_request(make_request("long", list(range(1, 1001)), max_tokens=4))
    assert _prompt_tokens(step(scheduler, runner)[0]) == 511


def test_among_decoding_rows_only_prompts_within_the_cap_join_whole() -> None:
    scheduler, runner = make_scheduler(num_blocks=256, block_size=16, max_num_batched_tokens=512,
                                       max_model_len=2048, decode_prompt_tokens_per_step=64,
                                       decode_step_bound_s=BOUND_S)
    scheduler.add_request(make_request("s0", [1] * 20, max_tokens=200))
    step(scheduler, runner)
    scheduler.add_request(make_request("short", [2] * 60, max_tokens=4))
    scheduler.add_request(make_request("mid", [3] * 300, max_tokens=4))
    output, _ = step(scheduler, runner)
    # The short prompt joins whole; the 300-token one is chunked, one block (the allowance
    # before any step was measured) in this step.
    assert {c.request.request_id: c.num_new_tokens for c in output.chunks} == {
        "s0": 1, "short": 60, "mid": 16}
    drain(scheduler, runner)


def drain(scheduler, runner) -> None:  # type: ignore[no-untyped-def]
    """Step until every request finished; every block is back in the pool."""
    while scheduler.has_unfinished_requests:
        step(scheduler, runner)
    scheduler.kv.check_integrity()
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
