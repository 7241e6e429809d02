"""A replica's tensor-parallel ranks as threads of the test process, each with its own gloo
group over a store on loopback: what a rank computes, without Ray or processes."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

from pdserve.engine.parallel.group import CollectiveGroup, connect_group, host_store

T = TypeVar("T")


def run_ranks(size: int, target: Callable[[CollectiveGroup], T], timeout_s: float = 120.0,
              collective_timeout_s: float = 60.0) -> list[T]:
    """Run ``target(group)`` for ranks 0..size-1 at once; return each rank's result, or raise
    the first rank's exception (a rank that fails breaks the others' collectives, which then
    fail too)."""
    rendezvous, store = host_store("127.0.0.1", size, collective_timeout_s)
    results: dict[int, T] = {}
    errors: dict[int, BaseException] = {}

    def rank_main(rank: int) -> None:
        group = connect_group(rendezvous, rank, torch.device("cpu"), collective_timeout_s,
                              store if rank == 0 else None)
        try:
            results[rank] = target(group)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller below
            errors[rank] = exc
        finally:
            group.close()

    threads = [threading.Thread(target=rank_main, args=(rank,), name=f"tp-rank-{rank}")
               for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    if any(thread.is_alive() for thread in threads):
        raise AssertionError(f"tensor-parallel ranks still running after {timeout_s}s")
    if errors:
        raise errors[min(errors)]
    return [results[rank] for rank in range(size)]
