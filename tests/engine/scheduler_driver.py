"""A model-free runner for scheduler tests: simulated KV slots and history-derived tokens.

Each computed position stores a digest of every token up to it; sampling reads all of a
request's positions back through its block table, so a wrong prefix hit, an evicted or
overwritten shared block, or a missing block shows up as an assertion or a changed token.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.kv.manager import KVCacheManager
from pdserve.engine.request import Request, RequestMode, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

EOS = 0


def prefix_digests(token_ids: Sequence[int]) -> list[int]:
    """digests[i] stands for the KV of position i: it depends on tokens[0..i]."""
    digests: list[int] = []
    digest = 17
    for token in token_ids:
        digest = (digest * 1_000_003 + token + 1) % (2**61 - 1)
        digests.append(digest)
    return digests


class FakeRunner:
    """Executes `SchedulerOutput`s against a simulated paged KV cache."""

    def __init__(self, kv: KVCacheManager, vocab_size: int = 50) -> None:
        self.kv = kv
        self.vocab_size = vocab_size
        self.slots: dict[tuple[int, int], int] = {}  # (block id, offset) -> digest
        self.num_steps = 0

    def write_kv(self, request: Request, start: int, end: int) -> None:
        """Store positions [start, end) of the request (a forward pass, or a received handoff)."""
        bs = self.kv.block_size
        block_ids = self.kv.block_ids(request.request_id)
        assert len(block_ids) * bs >= end, (
            f"{request.request_id}: {len(block_ids)} blocks cannot hold position {end - 1}"
        )
        digests = prefix_digests(request.token_ids_slice(0, end))
        for pos in range(start, end):
            self.slots[(block_ids[pos // bs], pos % bs)] = digests[pos]

    def next_token(self, request: Request, end: int) -> int:
        """Read positions [0, end) back; the token depends on all of them."""
        bs = self.kv.block_size
        block_ids = self.kv.block_ids(request.request_id)
        expected = prefix_digests(request.token_ids_slice(0, end))
        for pos in range(end):
            got = self.slots.get((block_ids[pos // bs], pos % bs))
            assert got == expected[pos], (
                f"{request.request_id}: KV of position {pos} in block {block_ids[pos // bs]} is "
                "not this request's (wrong prefix hit, or a shared block was overwritten)"
            )
        return expected[end - 1] % self.vocab_size

    def execute(self, output: SchedulerOutput) -> dict[str, int]:
        self.num_steps += 1
        sampled: dict[str, int] = {}
        for chunk in output.chunks:
            assert chunk.start_position == chunk.request.num_computed_tokens
            self.write_kv(chunk.request, chunk.start_position, chunk.end_position)
        for chunk in output.chunks:
            if chunk.samples:
                sampled[chunk.request.request_id] = self.next_token(
                    chunk.request, chunk.end_position
                )
        return sampled


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 8,
    max_model_len: int = 256,
    long_prefill_token_threshold: int = 0,
    enable_prefix_caching: bool = True,
    decode_prompt_tokens_per_step: int = 0,
    decode_step_bound_s: float = 0.05,
) -> tuple[Scheduler, FakeRunner]:
    kv = KVCacheManager(num_blocks, block_size, "test-model", enable_prefix_caching)
    config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        long_prefill_token_threshold=long_prefill_token_threshold,
        decode_prompt_tokens_per_step=decode_prompt_tokens_per_step,
        decode_step_bound_s=decode_step_bound_s,
    )
    return Scheduler(config, kv), FakeRunner(kv)


def make_request(
    request_id: str,
    prompt: Sequence[int],
    max_tokens: int = 8,
    ignore_eos: bool = True,
    mode: RequestMode = RequestMode.FULL,
    arrival_time: float | None = None,
    stop_token_ids: tuple[int, ...] = (),
) -> Request:
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos, stop_token_ids=stop_token_ids
    )
    request = Request(request_id, list(prompt), params, (EOS,), mode=mode)
    if arrival_time is not None:
        request.arrival_time = arrival_time
    return request


def step(
    scheduler: Scheduler, runner: FakeRunner, check: bool = True
) -> tuple[SchedulerOutput, list[Request]]:
    output = scheduler.schedule()
    if check:
        scheduler.check_integrity()
    changed = scheduler.update_from_output(output, runner.execute(output))
    if check:
        scheduler.check_integrity()
    return output, changed


def run_to_completion(
    scheduler: Scheduler, runner: FakeRunner, requests: Sequence[Request], max_steps: int = 10_000
) -> list[SchedulerOutput]:
    """Add the requests, step until none is live; returns every step's output."""
    for request in requests:
        scheduler.add_request(request)
    outputs: list[SchedulerOutput] = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests:
            return outputs
        output, _ = step(scheduler, runner)
        outputs.append(output)
    raise AssertionError(f"requests still live after {max_steps} steps")


def is_finished_with(request: Request, status: RequestStatus) -> bool:
    return request.status is status and request.finish_reason == status.finish_reason
