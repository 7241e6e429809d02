"""The token embedding split by vocabulary rows across TP ranks: each rank looks up the tokens
in its rows and the ranks' results are summed (every token has exactly one owner).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.parallel.group import SINGLE_RANK, TPGroup
from pdserve.engine.parallel.shard import TPShard


class VocabParallelEmbedding(nn.Module):
    """``weight`` holds rows ``[start, start + rows_per_rank)`` of the full table; rows past the
    vocabulary (the last rank's padding) are zero. One rank: a plain embedding lookup."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_start, self.num_rows, rows_per_rank = TPShard(tp.rank, tp.size).vocab_rows(
            vocab_size)
        self.weight = nn.Parameter(torch.empty(rows_per_rank, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_rows)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        hidden.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(hidden)

    def zero_padding(self) -> None:
        """Clear the rows past the vocabulary, which no checkpoint tensor fills."""
        with torch.no_grad():
            self.weight[self.num_rows:].zero_()
