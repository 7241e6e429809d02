"""Running the paged model the way the engine does, outside it: shuffled block tables over a
cache of noise, one step over chosen spans, and a schedule of chunked prompts then decode rows,
for the tests that hold every attention backend to transformers.
"""

from __future__ import annotations

import random

import torch

from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.models import CausalLM


def garbage_cache(model: CausalLM, num_blocks: int, block_size: int) -> torch.Tensor:
    """Large finite noise: reading any slot that was not written would swamp the attention."""
    c = model.config
    shape = (c.num_layers, 2, num_blocks, block_size, c.num_kv_heads, c.head_dim)
    return torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 100


def shuffled_block_tables(
    lengths: list[int], block_size: int, seed: int
) -> tuple[list[list[int]], int]:
    """Non-contiguous, shuffled block ids for each sequence, from a pool with spare blocks."""
    needed = [-(-n // block_size) for n in lengths]
    num_blocks = sum(needed) + 7
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    tables, start = [], 0
    for n in needed:
        tables.append(ids[start : start + n])
        start += n
    return tables, num_blocks


def run_step(
    model: CausalLM,
    cache: torch.Tensor,
    prompts: list[torch.Tensor],
    spans: list[tuple[int, int, int]],
    tables: list[list[int]],
    block_size: int,
) -> list[torch.Tensor]:
    """One forward over spans (seq index, start, stop); returns each span's logits."""
    metadata = AttentionMetadata.build(
        query_lens=[stop - start for _, start, stop in spans],
        seq_lens=[stop for _, _, stop in spans],
        block_tables=[tables[s][: -(-stop // block_size)] for s, _, stop in spans],
        block_size=block_size,
        device=prompts[0].device,
    )
    device = prompts[0].device
    input_ids = torch.cat([prompts[s][start:stop] for s, start, stop in spans])
    positions = torch.cat([torch.arange(start, stop, device=device) for _, start, stop in spans])
    logits = model.compute_logits(model(input_ids, positions, cache, metadata))
    return list(logits.split([stop - start for _, start, stop in spans]))


def chunk_schedule(length: int, block_size: int, num_decode: int = 3) -> list[int]:
    """Chunk sizes: a prefix that ends mid-block, the rest of the prompt, then single tokens."""
    if length <= num_decode + 1:
        return [1] * length
    first = max(1, (length - num_decode) // 2)
    if first % block_size == 0:
        first += 1  # make the first chunk end inside a block
    rest = length - num_decode - first
    return [first] + ([rest] if rest else []) + [1] * num_decode


def run_schedule(
    model: CausalLM,
    cache: torch.Tensor,
    prompts: list[torch.Tensor],
    tables: list[list[int]],
    block_size: int,
) -> tuple[list[torch.Tensor], bool]:
    """Feed every prompt by `chunk_schedule`, all sequences stepping together.

    Returns each sequence's logits for all its positions, and whether some step mixed
    single-token rows with multi-token chunks.
    """
    schedules = [chunk_schedule(len(p), block_size) for p in prompts]
    done = [0] * len(prompts)
    collected: list[list[torch.Tensor]] = [[] for _ in prompts]
    saw_mixed_batch = False
    for step in range(max(len(s) for s in schedules)):
        spans = [
            (s, done[s], done[s] + sched[step])
            for s, sched in enumerate(schedules)
            if step < len(sched)
        ]
        sizes = {stop - start for _, start, stop in spans}
        saw_mixed_batch |= 1 in sizes and len(sizes) > 1
        step_logits = run_step(model, cache, prompts, spans, tables, block_size)
        for (s, _, stop), logits in zip(spans, step_logits, strict=True):
            collected[s].append(logits)
            done[s] = stop
    return [torch.cat(pieces) for pieces in collected], saw_mixed_batch
