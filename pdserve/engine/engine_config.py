"""The settings of one engine instance: model, dtype, device, KV cache size and batch limits.

Values only: the config schema (`cluster/config_sections.EngineSection`) holds every default
and check, and `EngineSection.to_engine_config` fills this in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.cpu_affinity import CpuAffinity
from pdserve.engine.kv.layout import DTYPE_BY_NAME


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    model_path: str
    dtype: str  # a DTYPE_BY_NAME key, or "auto" (`auto_dtype`: chosen by the device)
    device: str  # "auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:N"
    block_size: int
    # Blocks in the cache; None: sized from kv_cache_memory_gb (`kv/cache.py` `num_kv_blocks_for`).
    num_kv_blocks: int | None
    kv_cache_memory_gb: float
    # On CUDA: the fraction of the device's memory the worker may use, the KV cache taking what
    # is left of it (`memory_profile.plan_kv_cache`); None: the size above, on every device.
    gpu_memory_utilization: float | None
    # The fraction of its device this worker owns: colocated replicas with fractional GPUs
    # share one, each sizing its KV from its share (`kv/sizing.py` `kv_budget_from_memory`).
    device_share: float
    # Device memory the worker's KV handoff stages pieces in, kept out of a measured KV cache
    # (0: a worker without a handoff).
    handoff_staging_bytes: int
    max_num_batched_tokens: int
    max_num_seqs: int
    # None: the model's max_position_embeddings (`kv/cache.py` `max_model_len_for`).
    max_model_len: int | None
    enable_prefix_caching: bool
    # Host tier per worker in GiB (0: none): evicted cached blocks live on there.
    host_kv_cache_gb: float
    # "measured" (the cost model chooses load or compute) or "always" (every tier hit loads).
    kv_load_policy: str
    # Prefill role: pull a longer prefix that another prefill worker caches when that beats
    # computing it; a pull's assumed cost until one is measured.
    peer_kv_pull: bool
    peer_link_latency_s: float
    peer_link_bytes_per_s: float
    # Cap on one request's prefill chunk per step (0: no cap beyond the step budget), so a
    # long prompt cannot stall the decodes that share its steps.
    long_prefill_token_threshold: int
    # Cap on the longer prompts' chunk tokens of a step that has rows decoding (0: none),
    # fewer when fewer fit in decode_step_bound_s at the measured token cost
    # (`prompt_allowance.py`).
    decode_prompt_tokens_per_step: int
    decode_step_bound_s: float
    # torch intra-op threads of the worker (None: the claimed core set's size, else torch's).
    num_threads: int | None
    # Core sets the worker claims one of and binds to (cpu_affinity.apply_cpu_settings).
    cpu_affinity: CpuAffinity | None
    # Idle pinned workers lend their cores to other workers' steps (cpu_lending.py).
    cpu_lending: bool

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        return DTYPE_BY_NAME[auto_dtype(device) if self.dtype == "auto" else self.dtype]

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


def auto_dtype(device: torch.device) -> str:
    """model.dtype auto: half precision where the device computes it fast (fp32 on a GPU means
    fp32 weights and KV, IEEE dots in the Triton kernel and no flash-attn), float32 on CPU."""
    if device.type != "cuda":
        return "float32"
    return "bfloat16" if torch.cuda.get_device_capability(device) >= (8, 0) else "float16"
