"""Tensor parallelism inside one replica: the rank group, how a model and its KV heads split
across ranks, the step plan rank 0 broadcasts, and the engine that runs on every other rank.
"""

from pdserve.engine.parallel.group import (
    SINGLE_RANK,
    CollectiveGroup,
    Rendezvous,
    TPGroup,
    connect_group,
)
from pdserve.engine.parallel.shard import TPShard, check_tp_fits

__all__ = ["SINGLE_RANK", "CollectiveGroup", "Rendezvous", "TPGroup", "TPShard",
           "check_tp_fits", "connect_group"]
