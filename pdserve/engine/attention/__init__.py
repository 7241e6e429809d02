"""Paged attention: per-step metadata, the backend contract, and the backend choice per device.

flash-attn or pdserve's Triton kernel on CUDA, plain PyTorch on CPU (`selection.py` says when).
"""

from __future__ import annotations

from pdserve.engine.attention.backend import AttentionBackend
from pdserve.engine.attention.metadata import AttentionMetadata
from pdserve.engine.attention.selection import (
    AttentionChoice,
    BackendRule,
    choose_backend,
    select_attention_backend,
)
from pdserve.engine.attention.torch_backend import TorchAttentionBackend

__all__ = [
    "AttentionBackend",
    "AttentionChoice",
    "AttentionMetadata",
    "BackendRule",
    "TorchAttentionBackend",
    "choose_backend",
    "select_attention_backend",
]
