"""Sizes a worker's KV cache on its device: from the config, or on CUDA by measuring what one
engine step at full size costs after the weights loaded (`kv/sizing.py` does the arithmetic); and
the start-up line that says what came out.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.attention.metadata import AttentionMetadata
from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.kv.cache import allocate_kv_cache
from pdserve.engine.kv.layout import KVLayout
from pdserve.engine.kv.sizing import (
    DeviceMemory,
    KVBudget,
    kv_budget_from_memory,
    kv_budget_from_size,
)
from pdserve.engine.parallel.group import SINGLE_RANK, TPGroup


def plan_kv_cache(config: EngineConfig, layout: KVLayout, model: nn.Module,
                  device: torch.device, max_model_len: int,
                  tp: TPGroup = SINGLE_RANK) -> KVBudget:
    """CUDA with a utilization measures; otherwise the configured size (the schema fills in
    its default when none was given). The ranks of a TP group (each calls this at the same
    point: the profile step and the agreement are collectives) all get the smallest count."""
    if device.type != "cuda" or config.gpu_memory_utilization is None:
        budget = kv_budget_from_size(layout, config.num_kv_blocks, config.kv_cache_memory_gb)
    else:
        num_tokens = min(config.max_num_batched_tokens, max_model_len)
        memory = profile_device_memory(model, layout, num_tokens,
                                       min(config.max_num_seqs, num_tokens), device)
        budget = kv_budget_from_memory(layout, memory, config.gpu_memory_utilization,
                                       config.handoff_staging_bytes, config.device_share)
    if tp.size == 1:
        return budget
    num_blocks = tp.min_int(budget.num_blocks)
    return KVBudget(num_blocks, budget.kv_bytes * num_blocks // budget.num_blocks,
                    f"{budget.reason}; the fewest of {tp.size} TP ranks")


def describe_engine(device: torch.device, model: nn.Module, layout: KVLayout,
                    budget: KVBudget, staging_bytes: int) -> str:
    """Device, attention backend and why, KV blocks and bytes, staging bytes."""
    where = str(device)
    if device.type == "cuda":
        where += f" ({torch.cuda.get_device_name(device)})"
    backend = getattr(model, "attention_backend", None)
    return (f"device {where}; attention {getattr(backend, 'name', '?')} "
            f"({getattr(model, 'attention_reason', '?')}); KV cache {budget.num_blocks} blocks "
            f"of {layout.block_size} tokens, {budget.kv_bytes / 2**30:.3f} GiB ({budget.reason}); "
            f"handoff staging {staging_bytes / 2**20:.2f} MiB")


@torch.inference_mode()
def profile_device_memory(model: nn.Module, layout: KVLayout, num_tokens: int,
                          num_rows: int, device: torch.device) -> DeviceMemory:
    """Run one prompt of ``num_tokens`` through ``model`` over a cache just big enough for it,
    with logits and float32 probabilities for ``num_rows`` of them (a full batch samples that
    many), then report the device's total and free memory and the step's peak activations."""
    num_blocks = -(-num_tokens // layout.block_size)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    cache = allocate_kv_cache(layout, num_blocks, device)
    metadata = AttentionMetadata.build([num_tokens], [num_tokens], [list(range(num_blocks))],
                                       layout.block_size, device)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, device=device)
    hidden = model(ids, positions, cache, metadata)
    logits = model.compute_logits(hidden[-num_rows:])  # None on TP ranks other than 0
    probs = None if logits is None else torch.softmax(logits.float(), dim=-1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before - cache.numel() * cache.element_size()
    del cache, hidden, probs
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total_bytes=total, free_bytes=free, peak_activation_bytes=max(0, peak),
                        own_bytes=torch.cuda.memory_reserved(device))
