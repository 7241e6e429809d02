"""Paged attention: per-step metadata, the backend contract, and the backend choice per device.

flash-attn on CUDA when it imports (and the dtype is fp16/bf16), plain PyTorch otherwise.
"""

from __future__ import annotations

import logging

import torch

from pdserve.engine.attention.backend import AttentionBackend
from pdserve.engine.attention.metadata import AttentionMetadata
from pdserve.engine.attention.torch_backend import TorchAttentionBackend

logger = logging.getLogger(__name__)

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "TorchAttentionBackend",
    "select_attention_backend",
]

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def select_attention_backend(
    device: torch.device | str, dtype: torch.dtype | None = None
) -> AttentionBackend:
    """flash-attn on CUDA when installed and `dtype` (if given) is fp16/bf16; else torch."""
    if torch.device(device).type != "cuda":
        return TorchAttentionBackend()
    if dtype is not None and dtype not in _FLASH_DTYPES:
        logger.info("attention backend: torch (flash-attn does not run %s)", dtype)
        return TorchAttentionBackend()
    try:
        from pdserve.engine.attention.flash_backend import FlashAttentionBackend

        backend: AttentionBackend = FlashAttentionBackend()
    except ImportError as exc:
        # Counted in the log, not hidden: CUDA without flash-attn is a slower but valid setup.
        logger.warning(
            "attention backend: torch on CUDA, because flash-attn did not import (%s)", exc
        )
        return TorchAttentionBackend()
    logger.info("attention backend: flash-attn")
    return backend
