"""Turns one scheduler step into tensors, runs the model over the paged cache, and samples.

The runner owns no request state: the scheduler says what to compute, the runner computes it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from pdserve.engine.attention.metadata import AttentionMetadata
from pdserve.engine.sampler import Sampler, TokenLogprobs
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
    sample_request_ids: list[str]


class ModelRunner:
    """Runs `model` on the chunks of a `SchedulerOutput` against one KV cache tensor."""

    def __init__(
        self, model: nn.Module, kv_cache: torch.Tensor, block_size: int, device: torch.device
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()

    def prepare(
        self, output: SchedulerOutput, block_ids_of: Callable[[str], list[int]]
    ) -> BatchInputs:
        token_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        block_tables: list[list[int]] = []
        sample_rows: list[int] = []
        sample_request_ids: list[str] = []
        for chunk in output.chunks:
            request = chunk.request
            start, end = chunk.start_position, chunk.start_position + chunk.num_new_tokens
            token_ids.extend(request.token_ids_slice(start, end))
            positions.extend(range(start, end))
            query_lens.append(chunk.num_new_tokens)
            seq_lens.append(end)
            block_tables.append(block_ids_of(request.request_id))
            if chunk.samples:
                sample_rows.append(len(token_ids) - 1)
                sample_request_ids.append(request.request_id)
        metadata = AttentionMetadata.build(
            query_lens, seq_lens, block_tables, self.block_size, self.device
        )
        return BatchInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            attn_metadata=metadata,
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=self.device),
            sample_request_ids=sample_request_ids,
        )

    @torch.inference_mode()
    def execute(
        self,
        output: SchedulerOutput,
        block_ids_of: Callable[[str], list[int]],
        generators: Mapping[str, torch.Generator | None],
        layer_hook: Callable[[int], None] | None = None,
    ) -> StepResult:
        batch = self.prepare(output, block_ids_of)
        hidden = self.model(
            batch.input_ids, batch.positions, self.kv_cache, batch.attn_metadata, layer_hook
        )
        if not batch.sample_request_ids:
            return StepResult({}, {}, int(batch.input_ids.numel()))
        logits = self.model.compute_logits(hidden.index_select(0, batch.sample_rows))
        requests = {c.request.request_id: c.request for c in output.chunks}
        ids = batch.sample_request_ids
        sampled = self.sampler.sample(
            logits, [requests[i].sampling_params for i in ids], [generators.get(i) for i in ids],
            [requests[i].output_token_ids for i in ids],
        )
        logprobs = (
            dict(zip(ids, sampled.logprobs, strict=True)) if sampled.logprobs is not None else {}
        )
        return StepResult(
            dict(zip(ids, sampled.token_ids, strict=True)), logprobs, int(batch.input_ids.numel())
        )
