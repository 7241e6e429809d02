"""Turns one scheduler step into tensors, runs the model over the paged cache, and samples.

The runner owns no request state: the scheduler says what to compute, the runner computes it.
Under tensor parallelism rank 0's runner broadcasts each step's plan and samples; the other
ranks' runners run the same plan (`run_plan`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pdserve.engine.attention.metadata import AttentionMetadata
from pdserve.engine.grammar_masks import GrammarMasks
from pdserve.engine.logprobs import TokenLogprobs
from pdserve.engine.parallel.group import SINGLE_RANK, TPGroup
from pdserve.engine.parallel.step_plan import StepPlan
from pdserve.engine.random_draws import DrawKey, draw_bits, uniforms_from_bits
from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler
from pdserve.engine.scheduler import SchedulerOutput


@dataclass(frozen=True)
class StepResult:
    """What one forward pass produced: a next token for every chunk that samples."""

    sampled_token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprobs | None]
    num_tokens_computed: int


@dataclass(frozen=True)
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    sample_rows: torch.Tensor  # index into the flattened tokens of each sampling chunk's last token
    sample_uniforms: torch.Tensor  # float32, each sampling chunk's draw (`random_draws`)


class ModelRunner:
    """Runs `model` on the chunks of a `SchedulerOutput` against one KV cache tensor."""

    def __init__(
        self, model: nn.Module, kv_cache: torch.Tensor, block_size: int, device: torch.device
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.tp: TPGroup = getattr(model, "tp", SINGLE_RANK)
        self.sampler = Sampler()
        # Set by the engine: the matchers of requests that follow a grammar.
        self.grammars: GrammarMasks | None = None
        # Rank 0's worker: per request id, plain data the other ranks' workers need this step.
        self.attach: Callable[[SchedulerOutput], dict[str, Any]] | None = None

    @staticmethod
    def plan(
        output: SchedulerOutput, block_ids_of: Callable[[str], Sequence[int]]
    ) -> tuple[StepPlan, list[Request]]:
        """The step as plain lists (what every rank needs), and the requests that sample."""
        token_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        block_tables: list[Sequence[int]] = []
        request_ids: list[str] = []
        sample_rows: list[int] = []
        sample_chunks: list[int] = []
        sample_requests: list[Request] = []
        for index, chunk in enumerate(output.chunks):
            request = chunk.request
            start, end = chunk.start_position, chunk.end_position
            if end - start == 1:  # a decode row: no list slices for one token
                token_ids.append(request.token_id(start))
                positions.append(start)
            else:
                token_ids.extend(request.token_ids_slice(start, end))
                positions.extend(range(start, end))
            query_lens.append(end - start)
            seq_lens.append(end)
            block_tables.append(block_ids_of(request.request_id))
            request_ids.append(request.request_id)
            if chunk.samples:
                sample_rows.append(len(token_ids) - 1)
                sample_chunks.append(index)
                sample_requests.append(request)
        plan = StepPlan(token_ids, positions, query_lens, seq_lens, block_tables, request_ids,
                        sample_rows, sample_chunks)
        return plan, sample_requests

    def prepare(self, plan: StepPlan, bits: list[int]) -> BatchInputs:
        """The step's inputs as device tensors, crossing to a GPU in one copy; ``bits``: each
        sampling chunk's draw (`random_draws.draw_bits`; empty on ranks that do not sample)."""
        metadata, (input_ids, positions_t, sample_rows_t, bits_t) = AttentionMetadata.build_with(
            plan.query_lens, plan.seq_lens, plan.block_tables, self.block_size, self.device,
            extra=(plan.token_ids, plan.positions, plan.sample_rows, bits),
        )
        return BatchInputs(
            input_ids=input_ids,
            positions=positions_t,
            attn_metadata=metadata,
            sample_rows=sample_rows_t,
            sample_uniforms=uniforms_from_bits(bits_t),
        )

    @torch.inference_mode()
    def execute(
        self,
        output: SchedulerOutput,
        block_ids_of: Callable[[str], Sequence[int]],
        draws: Mapping[str, DrawKey],
        layer_hook: Callable[[int], None] | None = None,
    ) -> StepResult:
        """Rank 0 (or a replica of one rank): run the step and sample. ``draws``: the key of
        every chunk that samples at random (greedy ones have none)."""
        plan, requests = self.plan(output, block_ids_of)
        if self.tp.size > 1:
            if self.attach is not None:
                plan = dataclasses.replace(plan, attachments=self.attach(output))
            self.tp.broadcast_plan(plan.encode())
        bits = draw_bits([draws.get(r.request_id) for r in requests])
        batch = self.prepare(plan, bits)
        # The grammar rows' mask (filled while the model runs, on CUDA).
        mask = self.grammars.start(requests) if self.grammars is not None else None
        hidden = self._forward(batch, layer_hook)
        num_computed = len(plan.token_ids)
        if not requests:
            return StepResult({}, {}, num_computed)
        logits = self._logits(hidden, batch)
        assert logits is not None  # rank 0 gathers every rank's vocabulary rows
        sampled = self.sampler.sample(
            logits,
            [r.sampling_params for r in requests],
            batch.sample_uniforms,
            [r.output_token_ids for r in requests],
            mask.result() if mask is not None else None,
        )
        ids = [r.request_id for r in requests]
        logprobs = (
            dict(zip(ids, sampled.logprobs, strict=True)) if sampled.logprobs is not None else {}
        )
        return StepResult(dict(zip(ids, sampled.token_ids, strict=True)), logprobs, num_computed)

    @torch.inference_mode()
    def run_plan(self, plan: StepPlan, layer_hook: Callable[[int], None] | None = None) -> None:
        """Ranks other than 0: the step rank 0 broadcast, this rank's part of every collective
        included (its vocabulary rows of the logits go to rank 0, which samples)."""
        batch = self.prepare(plan, [])
        hidden = self._forward(batch, layer_hook)
        if plan.sample_rows:
            self._logits(hidden, batch)

    def _forward(self, batch: BatchInputs,
                 layer_hook: Callable[[int], None] | None) -> torch.Tensor:
        return self.model(  # type: ignore[no-any-return]
            batch.input_ids, batch.positions, self.kv_cache, batch.attn_metadata, layer_hook)

    def _logits(self, hidden: torch.Tensor, batch: BatchInputs) -> torch.Tensor | None:
        if len(batch.sample_rows) < hidden.shape[0]:
            hidden = hidden.index_select(0, batch.sample_rows)
        return self.model.compute_logits(hidden)  # type: ignore[no-any-return]
