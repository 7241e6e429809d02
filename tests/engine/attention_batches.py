"""Ragged attention batches over a shuffled paged cache, shared by the Triton kernel's cases
under the interpreter (CPU) and its compiled cases on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.engine.attention import AttentionMetadata, TorchAttentionBackend

# (query_len, seq_len): decode rows, a whole prompt, chunks after a cached prefix (one ending
# mid-block, one longer than a kernel tile), a one-token context.
BATCH = [(1, 37), (23, 23), (9, 40), (1, 1), (40, 75), (1, 16)]


def ragged_batch(block_size: int, heads: int, kv_heads: int, dtype: torch.dtype, seed: int,
                 head_dim: int = 16, device: str = "cpu",
                 batch: Sequence[tuple[int, int]] = BATCH,
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Query rows, one layer's cache ``[2, blocks, block_size, kv_heads, head_dim]`` and the
    metadata of ``batch``, each sequence's blocks scattered through the cache."""
    generator = torch.Generator().manual_seed(seed)
    needed = [-(-seq_len // block_size) for _, seq_len in batch]
    num_blocks = sum(needed) + 5
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables, start = [], 0
    for n in needed:
        tables.append(order[start:start + n])
        start += n
    metadata = AttentionMetadata.build([q for q, _ in batch], [s for _, s in batch], tables,
                                       block_size, device)
    # Large values in unused slots: a read outside a context would swamp the result.
    cache = (torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=generator)
             * 3).to(dtype).to(device)
    query = torch.randn(metadata.num_tokens, heads, head_dim,
                        generator=generator).to(dtype).to(device)
    return query, cache, metadata


def torch_reference(query: torch.Tensor, cache: torch.Tensor, metadata: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """The torch backend's answer in float32 (PyTorch ops only), the reference every kernel
    case compares with."""
    block_size, kv_heads = cache.shape[2], cache.shape[3]
    reference = TorchAttentionBackend(c_kernel=False)
    plan = reference.prepare(metadata, block_size, kv_heads, torch.float32)
    return reference.attend(query.float(), cache.float(), metadata, plan, scale)
