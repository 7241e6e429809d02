"""What a worker holds of its replica's ranks, without knowing how they run: it starts them
with its engine, asks after them on each health check, and ends them with the replica.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.parallel.group import SINGLE_RANK, TPGroup

T = TypeVar("T")


class ReplicaRanks(Protocol):
    """The ranks of one replica, held by rank 0."""

    def check(self) -> None:
        """Raise when a rank other than 0 died or left its loop (never blocks)."""

    def close(self) -> None:
        """End the other ranks (after rank 0's engine stopped)."""

    def receiver(self, rank: int) -> Any:
        """Rank ``rank``'s (> 0) KV receiver on a decode replica: a `handoff.RankReceiver`
        (typed there: the engine knows nothing of the handoff)."""

    def sends(self, rank: int) -> Any:
        """Rank ``rank``'s (> 0) KV sends on a prefill replica: a `prefill.worker.RankSends`."""


class RankStarter(Protocol):
    """Starts a replica's ranks; the cluster gives workers one (`pdserve.ranks` runs them as
    Ray actors), so the workers themselves need nothing of Ray."""

    def start(self, config: EngineConfig,
              build: Callable[[TPGroup], T]) -> tuple[ReplicaRanks, T]:
        """Start the other ranks and ``build(tp)`` rank 0's engine with them."""
        ...


class LoneRank:
    """A replica of one rank: nothing to start, watch or end."""

    def start(self, config: EngineConfig,
              build: Callable[[TPGroup], T]) -> tuple[ReplicaRanks, T]:
        return self, build(SINGLE_RANK)

    def check(self) -> None:
        """One rank has no other to lose."""

    def close(self) -> None:
        """Nothing runs beside rank 0."""

    def receiver(self, rank: int) -> Any:
        raise ValueError(f"a replica of one rank has no rank {rank}")

    def sends(self, rank: int) -> Any:
        raise ValueError(f"a replica of one rank has no rank {rank}")


ONE_RANK = LoneRank()
