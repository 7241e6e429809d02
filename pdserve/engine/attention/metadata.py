"""Per-step attention metadata: where each new token's K/V goes and what context each sequence sees.

Built once per forward step by the model runner; read by every layer's attention backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Value that pads block table rows. Backends never read a table entry past a sequence's length.
BLOCK_TABLE_PAD = 0


@dataclass
class AttentionMetadata:
    """A step's flattened batch: T new tokens from S sequences, sequence after sequence.

    Sequence ``s`` contributes ``query_lens[s]`` new tokens, which are the last positions
    of its ``seq_lens[s]``-token context (cached prefix + new tokens). Block ``j`` of its
    context lives in cache block ``block_tables[s, j]``.
    """

    query_lens: list[int]
    seq_lens: list[int]
    query_start_loc: torch.Tensor  # int32 [S+1]
    seq_lens_tensor: torch.Tensor  # int32 [S]
    block_tables: torch.Tensor  # int32 [S, max_blocks_per_seq], padded with BLOCK_TABLE_PAD
    slot_mapping: torch.Tensor  # int64 [T]
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str,
    ) -> AttentionMetadata:
        """Derive the tensors from per-sequence lengths and block ids (vectorised)."""
        _validate(query_lens, seq_lens, block_tables, block_size)
        num_seqs = len(query_lens)
        max_blocks = max(len(row) for row in block_tables)
        table = torch.tensor(
            [row + [BLOCK_TABLE_PAD] * (max_blocks - len(row)) for row in block_tables],
            dtype=torch.int64,
        )
        q_lens = torch.tensor(query_lens, dtype=torch.int64)
        s_lens = torch.tensor(seq_lens, dtype=torch.int64)
        starts = torch.zeros(num_seqs + 1, dtype=torch.int64)
        torch.cumsum(q_lens, 0, out=starts[1:])
        num_tokens = int(starts[-1])
        seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), q_lens)
        offset_in_query = torch.arange(num_tokens) - starts[seq_of_token]
        positions = (s_lens - q_lens)[seq_of_token] + offset_in_query
        blocks = table[seq_of_token, positions // block_size]
        slots = blocks * block_size + positions % block_size
        return cls(
            query_lens=list(query_lens),
            seq_lens=list(seq_lens),
            query_start_loc=starts.to(torch.int32).to(device),
            seq_lens_tensor=s_lens.to(torch.int32).to(device),
            block_tables=table.to(torch.int32).to(device),
            slot_mapping=slots.to(device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )


def _validate(
    query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int
) -> None:
    if not query_lens:
        raise ValueError("AttentionMetadata.build needs at least one sequence")
    if not len(query_lens) == len(seq_lens) == len(block_tables):
        raise ValueError(
            f"query_lens ({len(query_lens)}), seq_lens ({len(seq_lens)}) and block_tables "
            f"({len(block_tables)}) must have one entry per sequence"
        )
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    for s, (q_len, s_len, row) in enumerate(zip(query_lens, seq_lens, block_tables, strict=True)):
        if not 0 < q_len <= s_len:
            raise ValueError(f"sequence {s}: need 0 < query_len ({q_len}) <= seq_len ({s_len})")
        if len(row) * block_size < s_len:
            raise ValueError(
                f"sequence {s}: {len(row)} blocks of {block_size} cannot hold {s_len} tokens"
            )
