"""Building blocks of Llama-family decoders: RMSNorm and the SwiGLU MLP with fused gate/up.

Numerics follow Hugging Face transformers (norm in float32, scale in the model dtype).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.parallel.group import SINGLE_RANK, TPGroup


class RMSNorm(nn.Module):
    """Root-mean-square norm; computed in float32, then scaled by `weight` in the input dtype."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's rms_norm computes transformers' float32 formula in one call.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up share one matmul (rows [gate; up]).

    Under TP ``intermediate_size`` is this rank's share: gate/up split by columns, down by
    rows, its partial sums added across ranks.
    """

    def __init__(self, hidden_size: int, intermediate_size: int,
                 tp: TPGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.tp = tp
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        # In place on the fresh projection output: no [tokens, intermediate] temporaries
        # (large CPU allocations page-fault on first touch). Inference only.
        return self.tp.all_reduce(self.down_proj(F.silu(gate, inplace=True).mul_(up)))
