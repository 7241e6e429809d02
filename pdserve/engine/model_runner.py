"""Turns one scheduler step into tensors, runs the model over the paged cache, and samples.

The runner owns no request state: the scheduler says what to compute, the runner computes it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from pdserve.engine.attention.metadata import AttentionMetadata
from pdserve.engine.random_draws import DrawKey, draw_bits, uniforms_from_bits
from pdserve.engine.request import Request
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
    sample_requests: list[Request]
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
        self.sampler = Sampler()

    def prepare(
        self,
        output: SchedulerOutput,
        block_ids_of: Callable[[str], list[int]],
        draws: Mapping[str, DrawKey],
    ) -> BatchInputs:
        """The step's inputs as device tensors, crossing to a GPU in one copy; ``draws``: the
        key of every chunk that samples at random (greedy ones have none)."""
        token_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        block_tables: list[list[int]] = []
        sample_rows: list[int] = []
        sample_requests: list[Request] = []
        for chunk in output.chunks:
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
            if chunk.samples:
                sample_rows.append(len(token_ids) - 1)
                sample_requests.append(request)
        bits = draw_bits([draws.get(r.request_id) for r in sample_requests])
        metadata, (input_ids, positions_t, sample_rows_t, bits_t) = AttentionMetadata.build_with(
            query_lens, seq_lens, block_tables, self.block_size, self.device,
            extra=(token_ids, positions, sample_rows, bits),
        )
        return BatchInputs(
            input_ids=input_ids,
            positions=positions_t,
            attn_metadata=metadata,
            sample_rows=sample_rows_t,
            sample_requests=sample_requests,
            sample_uniforms=uniforms_from_bits(bits_t),
        )

    @torch.inference_mode()
    def execute(
        self,
        output: SchedulerOutput,
        block_ids_of: Callable[[str], list[int]],
        draws: Mapping[str, DrawKey],
        layer_hook: Callable[[int], None] | None = None,
    ) -> StepResult:
        batch = self.prepare(output, block_ids_of, draws)
        hidden = self.model(
            batch.input_ids, batch.positions, self.kv_cache, batch.attn_metadata, layer_hook
        )
        num_computed = len(batch.attn_metadata.slot_mapping)
        requests = batch.sample_requests
        if not requests:
            return StepResult({}, {}, num_computed)
        if len(requests) < hidden.shape[0]:
            hidden = hidden.index_select(0, batch.sample_rows)
        logits = self.model.compute_logits(hidden)
        sampled = self.sampler.sample(
            logits,
            [r.sampling_params for r in requests],
            batch.sample_uniforms,
            [r.output_token_ids for r in requests],
        )
        ids = [r.request_id for r in requests]
        logprobs = (
            dict(zip(ids, sampled.logprobs, strict=True)) if sampled.logprobs is not None else {}
        )
        return StepResult(dict(zip(ids, sampled.token_ids, strict=True)), logprobs, num_computed)
