"""A model with everything that travels with it: config, tokenizer, fingerprint.

Loaded once per process; several engines (tests, benchmarks) may share one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pdserve.engine.checkpoint import load_model, model_fingerprint
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.models.packed_linear import pack_linears
from pdserve.engine.parallel.group import SINGLE_RANK, TPGroup
from pdserve.engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    tokenizer: Tokenizer
    fingerprint: str
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def load(
        cls, path: str, dtype: torch.dtype, device: torch.device, progress: bool = False,
        block_size: int | None = None, tp: TPGroup = SINGLE_RANK,
    ) -> LoadedModel:
        """``block_size``: the KV cache's, which decides the attention backend on CUDA (None:
        one that serves any block size); ``tp``: the replica's ranks (this rank's part loads)."""
        model, config = load_model(path, dtype, device, progress=progress, block_size=block_size,
                                   tp=tp)
        model.eval()
        pack_linears(model, dtype, device)
        return cls(
            model=model,
            config=config,
            tokenizer=Tokenizer.from_checkpoint(path),
            fingerprint=model_fingerprint(path, dtype),
            dtype=dtype,
            device=device,
        )
