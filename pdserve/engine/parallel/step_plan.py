"""What every rank of a replica needs to run one step's forward pass: the batch as plain lists,
built by rank 0's runner from its scheduler's output and broadcast as msgpack (never pickle).
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import astuple, dataclass, field, replace
from dataclasses import fields as dataclass_fields
from typing import Any

import msgpack


class StepPlanError(ValueError):
    """A broadcast plan that does not decode: ranks of different pdserve builds, or a bug."""


@dataclass(frozen=True)
class StepPlan:
    """One step's batch: ``query_lens[i]`` new tokens of chunk ``i`` (request
    ``request_ids[i]``, context ``seq_lens[i]``, cache blocks ``block_tables[i]``), their
    ``token_ids`` and ``positions`` flattened chunk after chunk; ``sample_rows[j]`` is the flat
    row whose logits chunk ``sample_chunks[j]`` samples from. ``attachments``: plain data per
    request id that rank 0's worker adds for the other ranks' workers (opaque to the engine;
    e.g. a prefill replica's KV routes for the requests whose last chunk runs)."""

    token_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    # Each an int64 `array.array` on the wire (msgpack bytes); lists are accepted to send.
    block_tables: list[Sequence[int]]
    request_ids: list[str]
    sample_rows: list[int]
    sample_chunks: list[int]
    attachments: dict[str, Any] = field(default_factory=dict)

    def encode(self) -> bytes:
        values = list(astuple(replace(self, block_tables=[])))
        values[_TABLES] = [array.array("q", table).tobytes() for table in self.block_tables]
        return msgpack.packb(values, use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> StepPlan:
        try:
            fields = msgpack.unpackb(data, raw=False, strict_map_key=True)
            fields[_TABLES] = [_block_table(table) for table in fields[_TABLES]]
            plan = cls(*fields)
            if not isinstance(plan.attachments, dict):
                raise TypeError("attachments must be a map")
        except (ValueError, TypeError, IndexError, KeyError, msgpack.UnpackException) as exc:
            raise StepPlanError(f"cannot decode a step plan: {exc}") from exc
        if not (len(plan.query_lens) == len(plan.seq_lens) == len(plan.block_tables)
                == len(plan.request_ids)) or len(plan.sample_rows) != len(plan.sample_chunks):
            raise StepPlanError("step plan fields disagree in length")
        return plan


_TABLES = [f.name for f in dataclass_fields(StepPlan)].index("block_tables")


def _block_table(data: object) -> array.array[int]:
    if not isinstance(data, bytes) or len(data) % 8:
        raise TypeError("a block table must be int64 bytes")
    table = array.array("q")
    table.frombytes(data)
    return table
