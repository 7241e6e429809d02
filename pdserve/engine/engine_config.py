"""The settings of one engine instance: model, dtype, device, KV cache size and batch limits.

Validated on construction so a bad value fails before any weight is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.cpu_affinity import CpuAffinity
from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.kv_layout import DTYPE_BY_NAME


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    dtype: str = "float32"
    device: str = "auto"  # "auto": CUDA when available, else CPU
    block_size: int = 16
    # Blocks in the cache; None sizes it from kv_cache_memory_gb, else (CUDA) from what the
    # device has free within gpu_memory_utilization, else (CPU) kv_sizing.CPU_DEFAULT_KV_GB.
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    # Device memory the worker's KV handoff stages pieces in, kept out of the KV cache: 0 for
    # a worker without a handoff; None: one step's KV (kv_sizing.default_staging_bytes).
    handoff_staging_bytes: int | None = 0
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    # None: the model's max_position_embeddings.
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # Cap on one request's prefill chunk per step (0: no cap beyond the step budget), so a
    # long prompt cannot stall the decodes that share its steps.
    long_prefill_token_threshold: int = 0
    # torch intra-op threads of the worker (None: the claimed core set's size, else torch's).
    num_threads: int | None = None
    # Core sets the worker claims one of and binds to (cpu_affinity.apply_cpu_settings).
    cpu_affinity: CpuAffinity | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BY_NAME:
            raise InvalidRequestError(
                f"dtype {self.dtype!r} is not supported; use one of {sorted(DTYPE_BY_NAME)}"
            )
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise InvalidRequestError(f"device {self.device!r} must be auto, cpu or cuda[:N]")
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) <= 0:
                raise InvalidRequestError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise InvalidRequestError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.num_threads is not None and self.num_threads <= 0:
            raise InvalidRequestError(f"num_threads must be positive, got {self.num_threads}")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise InvalidRequestError("kv_cache_memory_gb must be positive")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidRequestError(
                f"gpu_memory_utilization must lie in (0, 1], got {self.gpu_memory_utilization}")
        if self.handoff_staging_bytes is not None and self.handoff_staging_bytes < 0:
            raise InvalidRequestError("handoff_staging_bytes must be >= 0")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPE_BY_NAME[self.dtype]

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)
