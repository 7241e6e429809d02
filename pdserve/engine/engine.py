"""The engine loop: requests in, one batched forward pass per step, tokens and text out.

Used whole in one process (colocated), and by both disaggregated roles through their modes.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.engine_outputs import EngineStats, KVStats, ReceivedKVSlots, RequestOutput
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.grammar import GrammarCompiler, grammar_vocabulary
from pdserve.engine.grammar_masks import GrammarMasks
from pdserve.engine.kv.cache import (
    allocate_kv_cache,
    kv_layout_for,
    max_model_len_for,
)
from pdserve.engine.kv.manager import KVCacheManager
from pdserve.engine.kv_tiers import KVTiers
from pdserve.engine.loaded_model import LoadedModel
from pdserve.engine.logprobs import TokenLogprobs
from pdserve.engine.memory_profile import describe_engine, plan_kv_cache
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.parallel.group import SINGLE_RANK, TPGroup
from pdserve.engine.random_draws import DrawKey
from pdserve.engine.request import Request, RequestMode, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pdserve.engine.stop_strings import TextStream

logger = logging.getLogger(__name__)

LayerHook = Callable[[int, SchedulerOutput], None]
# Around a step's compute, given its prompt tokens: the cores it runs on (`cpu_lending.py`).
StepCores = Callable[[int], AbstractContextManager[None]]


@dataclass
class _Tracked:
    """Per-request engine-side state the scheduler does not own."""

    stream: TextStream
    draw_seed: int  # the request's seed, else a random one: keys its draws (`random_draws`)
    num_reported: int = 0
    added_at: float = field(default_factory=time.monotonic)
    first_scheduled_at: float | None = None


class LLMEngine:
    """Owns a model, its paged KV cache, a scheduler and a runner.

    Under tensor parallelism this is rank 0: its scheduler plans every step, its runner
    broadcasts the plan to the replica's other ranks (`shard_engine.py` `ShardEngine`), and
    it samples.

    Not thread-safe: one thread calls `add_request`/`step`/`abort` (workers serialize calls).
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 tp: TPGroup = SINGLE_RANK) -> None:
        self.config = config
        self.tp = tp
        device = config.resolve_device()
        if loaded is None:
            loaded = LoadedModel.load(config.model_path, config.resolve_dtype(device), device,
                                      progress=True, block_size=config.block_size, tp=tp)
        self.loaded = loaded
        self.device = loaded.device
        self.tokenizer = loaded.tokenizer
        self.max_model_len = max_model_len_for(loaded.config, config.max_model_len)
        self.layout = kv_layout_for(loaded.config, loaded.fingerprint, loaded.dtype,
                                    config.block_size, tp.rank, tp.size)
        self.kv_budget = plan_kv_cache(config, self.layout, loaded.model, self.device,
                                       self.max_model_len, tp)
        num_blocks = self.kv_budget.num_blocks
        self.kv_cache = allocate_kv_cache(self.layout, num_blocks, self.device)
        self.tiers = KVTiers(self.layout, self.kv_cache, config.host_kv_cache_gb,
                             config.enable_prefix_caching, config.kv_load_policy == "always")
        self.kv_manager = KVCacheManager(
            num_blocks, config.block_size, loaded.fingerprint, config.enable_prefix_caching,
            self.tiers.events, self.tiers.host.pool if self.tiers.host else None,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                max_model_len=self.max_model_len,
                long_prefill_token_threshold=config.long_prefill_token_threshold,
                decode_prompt_tokens_per_step=config.decode_prompt_tokens_per_step,
                decode_step_bound_s=config.decode_step_bound_s,
            ),
            self.kv_manager,
        )
        self.tiers.attach(self.kv_manager, self.scheduler)
        self.runner = ModelRunner(loaded.model, self.kv_cache, config.block_size, self.device)
        self.grammars = self._grammar_compiler()
        self.runner.grammars = GrammarMasks(self.grammars, self.device)
        self.stats = EngineStats()
        self.step_cores: StepCores | None = None
        self._tracked: dict[str, _Tracked] = {}

    def describe(self) -> str:
        """The start-up line every worker logs: device, attention and why, KV, staging."""
        line = describe_engine(self.device, self.loaded.model, self.layout, self.kv_budget,
                               self.config.handoff_staging_bytes)
        if self.tp.size > 1:
            line += f"; tensor parallel over {self.tp.size} ranks (this is rank 0)"
        return line

    def stop_ranks(self) -> None:
        """Tell the replica's other ranks to leave their step loop (engine thread only)."""
        if self.tp.size > 1:
            self.tp.broadcast_plan(None)

    # ---- requests in -------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        mode: RequestMode = RequestMode.FULL,
        resume_output_ids: Sequence[int] = (),
    ) -> Request:
        """Queue a request. `resume_output_ids` are output tokens already shown to the client
        (a recompute after a failed handoff): they are recomputed, not generated again."""
        request = self._make_request(request_id, prompt_token_ids, sampling_params, mode)
        request.output_token_ids.extend(resume_output_ids)
        self.scheduler.add_request(request)
        tracked = self._track(request)
        for token_id in resume_output_ids:
            tracked.stream.add(token_id)
        tracked.num_reported = len(resume_output_ids)
        return request

    def reserve_for_received_kv(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling_params: SamplingParams
    ) -> ReceivedKVSlots | None:
        """Decode role: hold blocks for a prompt whose KV will arrive from a prefill worker,
        reusing a prefix this worker holds. None when they do not fit now."""
        request = self._make_request(
            request_id, prompt_token_ids, sampling_params, RequestMode.FROM_RECEIVED_KV
        )
        block_ids = self.scheduler.reserve_for_received_kv(request)
        if block_ids is None:
            return None
        self._track(request)
        return ReceivedKVSlots(block_ids, request.num_cached_tokens)

    def activate_received(self, request_id: str, first_token_id: int) -> RequestOutput:
        """Decode role: the KV arrived and its fence verified; join the batch.

        The first token was already shown to the client by the prefill side, so its text is
        absorbed here (it still seeds detokenization and stop-string search).
        """
        # Fetched first: a first token that ends the request (max_tokens 1, EOS, a stop
        # token) finishes it inside activate_received, and the scheduler forgets it.
        request = self.scheduler.get_request(request_id)
        if request is None:
            raise InvalidRequestError(f"activate_received({request_id!r}): unknown request")
        self.scheduler.activate_received(request_id, first_token_id)
        tracked = self._tracked[request_id]
        tracked.stream.add(first_token_id)
        tracked.num_reported = 1
        if tracked.stream.stopped and not request.status.is_finished:
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)
        if request.status.is_finished:
            return self._finish_output(request, tracked, [first_token_id], "")
        return self._output(request, [first_token_id], "", finished=False)

    def abort(self, request_id: str) -> None:
        """Stop a request however far it got and free its blocks (no-op if unknown)."""
        if self.scheduler.get_request(request_id) is not None:
            self.stats.num_aborted += 1
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        self.scheduler.release(request_id)
        self._tracked.pop(request_id, None)

    def release(self, request_id: str) -> None:
        """Prefill role: the handoff is done with a PREFILLED request's blocks."""
        self.scheduler.release(request_id)
        self._tracked.pop(request_id, None)

    # ---- the loop ------------------------------------------------------------------------
    def step(self, layer_hook: LayerHook | None = None) -> list[RequestOutput]:
        self.tiers.service()
        output = self.scheduler.schedule()
        if not output.chunks:
            return []
        hook = None if layer_hook is None else (lambda layer: layer_hook(layer, output))
        draws = self._note_scheduled(output)
        started = time.monotonic()
        with (nullcontext() if self.step_cores is None else self.step_cores(
                sum(c.num_new_tokens for c in output.chunks if c.num_new_tokens > 1))):
            result = self.runner.execute(output, self.kv_manager.block_table, draws, hook)
        seconds = time.monotonic() - started
        self.scheduler.observe_step(output, seconds)
        if self.scheduler.loads is not None:  # the cost model exists for loads alone
            self._measure_prefill(output, seconds)
        self.stats.num_steps += 1
        self.stats.num_tokens_computed += result.num_tokens_computed
        self.stats.num_preemptions += len(output.preempted_request_ids)
        changed = self.scheduler.update_from_output(output, result.sampled_token_ids)
        outputs = [self._process(request, result.logprobs.get(request.request_id))
                   for request in changed]
        return [o for o in outputs if o is not None]

    def kv_stats(self) -> KVStats:
        """Checks the pool's integrity, then reports its counts."""
        self.scheduler.check_integrity()
        kv, sched = self.kv_manager, self.scheduler
        return KVStats(
            num_blocks=kv.num_blocks, num_free_blocks=kv.num_free_blocks,
            num_cached_blocks=kv.num_cached_blocks, num_waiting=sched.num_waiting,
            num_running=sched.num_running, num_awaiting_kv=sched.num_awaiting_kv,
            num_prefilled=sched.num_prefilled, num_aborted=self.stats.num_aborted,
            num_loading=sched.num_loading, tiers=self.tiers.stats(),
        )

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests

    def has_schedulable_requests(self) -> bool:
        """Whether a step has work: something to compute (requests awaiting KV or pinned
        have not), or tier copies to settle or start."""
        return self.scheduler.has_schedulable_requests or self.tiers.has_work

    def close(self) -> None:
        """Stop the tiers' copy thread (the engine is not used after)."""
        self.tiers.close()
        self.grammars.close()
        if self.runner.grammars is not None:
            self.runner.grammars.close()

    def _grammar_compiler(self) -> GrammarCompiler:
        tokenizer, vocab_size = self.tokenizer, self.loaded.config.vocab_size
        return GrammarCompiler(vocab_size, lambda: grammar_vocabulary(
            vocab_size, tokenizer.vocab_size, tokenizer.token_bytes, tokenizer.special_token_ids),
            tokenizer.eos_token_ids)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams],
    ) -> list[list[int]]:
        """Run prompts to completion together; return each one's output token ids."""
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        ids = [f"generate-{self.stats.num_steps}-{i}" for i in range(len(prompts))]
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        for rid, prompt, p in zip(ids, prompts, params, strict=True):
            self.add_request(rid, prompt, p)
        pending = set(ids)
        while pending:
            if not self.scheduler.has_schedulable_requests:
                self.tiers.wait_finished()  # every request loads: nothing to compute
            for out in self.step():
                tokens[out.request_id].extend(out.new_token_ids)
                if out.finished:
                    pending.discard(out.request_id)
        return [tokens[rid] for rid in ids]

    # ---- internals -----------------------------------------------------------------------
    def _measure_prefill(self, output: SchedulerOutput, seconds: float) -> None:
        """The step's prompt tokens per second, at the longest chunk's context (the cost
        model's compute side); decode tokens in the same step take their share of time."""
        prompt = [c for c in output.chunks if c.num_new_tokens > 1]
        if not prompt or output.num_batched_tokens <= 0:
            return
        num_prompt = sum(c.num_new_tokens for c in prompt)
        self.tiers.cost.observe_prefill(num_prompt, max(c.end_position for c in prompt),
                                        seconds * num_prompt / output.num_batched_tokens)

    def _note_scheduled(self, output: SchedulerOutput) -> dict[str, DrawKey]:
        """Stamps first-schedule times, and keys each random draw to (seed, output index), not
        to a generator's history, so the prefill worker's first token and the decode worker's
        later ones (or a recompute after a failed handoff) come out exactly as one engine
        alone would draw them. Returns the keys of the chunks that sample at random."""
        now = time.monotonic()
        draws: dict[str, DrawKey] = {}
        for chunk in output.chunks:
            request = chunk.request
            tracked = self._tracked.get(request.request_id)
            if tracked is None:
                continue
            if tracked.first_scheduled_at is None:
                tracked.first_scheduled_at = now
            if chunk.samples and not request.sampling_params.is_greedy:
                draws[request.request_id] = DrawKey(tracked.draw_seed,
                                                    len(request.output_token_ids))
        return draws

    def _make_request(self, request_id: str, prompt_token_ids: Sequence[int],
                      sampling_params: SamplingParams, mode: RequestMode) -> Request:
        if request_id in self._tracked:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty: give at least one token")
        vocab = self.loaded.config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})"
            )
        for name, ids in (("logit_bias", [t for t, _ in sampling_params.logit_bias]),
                          ("stop_token_ids", sampling_params.stop_token_ids)):
            outside = [t for t in ids if t >= vocab]
            if outside:  # a stop token the model can never sample would never stop anything
                raise InvalidRequestError(
                    f"{name} token id {outside[0]} is outside the vocabulary [0, {vocab})")
        if sampling_params.grammar is not None:
            # Compiles on the compiler's thread while the prompt is computed (or its KV
            # travels); the first mask waits for it only if it is not done by then.
            self.grammars.prefetch(sampling_params.grammar)
        return Request(request_id=request_id, prompt_token_ids=list(prompt_token_ids),
                       sampling_params=sampling_params,
                       eos_token_ids=self.tokenizer.eos_token_ids, mode=mode)

    def _track(self, request: Request) -> _Tracked:
        params = request.sampling_params
        tracked = _Tracked(
            stream=TextStream.create(self.tokenizer, params.stop),
            draw_seed=params.seed if params.seed is not None else random.getrandbits(64),
        )
        self._tracked[request.request_id] = tracked
        return tracked

    def _process(self, request: Request, logprobs: TokenLogprobs | None) -> RequestOutput | None:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            return None
        new_ids = request.output_token_ids[tracked.num_reported:]
        tracked.num_reported = len(request.output_token_ids)
        stream = tracked.stream
        text = stream.add(new_ids[0]) if len(new_ids) == 1 else "".join(map(stream.add, new_ids))
        # A PREFILLED request's blocks are still being sent: the decode side applies the stop.
        if (tracked.stream.stopped and not request.status.is_finished
                and request.status is not RequestStatus.PREFILLED):
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
        lp = [logprobs] if logprobs is not None else []
        if request.status.is_finished or request.status is RequestStatus.PREFILLED:
            return self._finish_output(request, tracked, new_ids, text, lp)
        return self._output(request, new_ids, text, finished=False, logprobs=lp)

    def _finish_output(
        self, request: Request, tracked: _Tracked, new_ids: list[int], text: str,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> RequestOutput:
        if request.status is not RequestStatus.PREFILLED:
            # A prefilled request's text goes on at the decode worker, which completes any
            # character split across tokens: flushing here would show it twice.
            text += tracked.stream.flush()
        output = self._output(request, new_ids, text, finished=True, logprobs=logprobs or [])
        if request.status is not RequestStatus.PREFILLED:
            self._tracked.pop(request.request_id, None)
        return output

    def _output(
        self, request: Request, new_ids: list[int], text: str, finished: bool,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> RequestOutput:
        """``new_ids`` becomes the output's own list: callers pass a fresh one."""
        if request.status is RequestStatus.PREFILLED:
            reason: str | None = "prefilled"
        else:
            reason = request.finish_reason if finished else None
        tracked = self._tracked.get(request.request_id)
        queue_s = 0.0
        if tracked is not None and tracked.first_scheduled_at is not None:
            queue_s = tracked.first_scheduled_at - tracked.added_at
        num_output = len(request.output_token_ids)
        before = num_output - len(new_ids)
        return RequestOutput(
            request_id=request.request_id,
            prev_token_id=request.output_token_ids[before - 1] if before > 0 else -1,
            new_token_ids=new_ids,
            new_text=text,
            finished=finished,
            finish_reason=reason,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_cached_tokens=request.num_cached_tokens,
            num_output_tokens=num_output,
            logprobs=logprobs or [],
            queue_s=queue_s,
            kv_reuse=request.kv_reuse,
        )
