"""A decode replica's KV reception over its tensor-parallel ranks: one route per (prefill rank,
decode rank, head range), each reserved in its decode rank's receiver over the same blocks;
the request is admitted only when every route's fence verified.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from pdserve.engine.kv.layout import KVLayout
from pdserve.handoff import FenceInfo, HandoffError, HandoffReceiver, HandoffTicket
from pdserve.handoff.routes import HeadRoute, group_ticket, route_heads, route_request_id


class RankReceiver(Protocol):
    """The KV receiver of a decode rank other than 0 (its actor, from rank 0's loop)."""

    async def reserve(self, request_id: str, block_ids: Sequence[int], num_tokens: int,
                      deadline: float, kv_heads: tuple[int, int]) -> dict[str, Any]: ...

    async def wait_ready(self, request_id: str) -> FenceInfo: ...

    async def cancel(self, request_id: str) -> bool: ...


class GroupReceiver:
    """Rank 0's view of every route into its replica. With one rank on each side there is
    one route, reserved under the request's own id, and its ticket travels plain."""

    def __init__(self, local: HandoffReceiver, layout: KVLayout, sender_tp_size: int,
                 remote: Callable[[int], RankReceiver], timeout_s: float) -> None:
        self.local, self.layout = local, layout
        sender = dataclasses.replace(layout, tp_rank=0, tp_size=sender_tp_size)
        self.routes: list[HeadRoute] = route_heads(sender, layout)
        self._remote = {rank: remote(rank) for rank in
                        {r.receiver_rank for r in self.routes if r.receiver_rank}}
        self.timeout_s = timeout_s

    def route_id(self, request_id: str, route: HeadRoute) -> str:
        return request_id if len(self.routes) == 1 else route_request_id(request_id, route)

    async def reserve(self, request_id: str, block_ids: Sequence[int],
                      num_tokens: int) -> dict[str, Any]:
        """Reserve every route into ``block_ids``; the ticket the prefill replica fills.
        Failing part way, the routes reserved so far are cancelled."""
        deadline = time.time() + self.timeout_s  # one deadline: the group's KV is whole or not
        tickets: list[tuple[int, HandoffTicket]] = []
        try:
            for route in self.routes:
                rid = self.route_id(request_id, route)
                if route.receiver_rank == 0:
                    ticket = self.local.reserve(rid, block_ids, self.layout, num_tokens,
                                                deadline, route.heads)
                else:
                    ticket = HandoffTicket.from_dict(await self._remote[route.receiver_rank]
                                                     .reserve(rid, block_ids, num_tokens,
                                                              deadline, route.heads))
                tickets.append((route.sender_rank, ticket))
        except BaseException:
            await self.cancel(request_id)
            raise
        return group_ticket(tickets)

    async def wait_ready(self, request_id: str) -> FenceInfo:
        """Once every route's fence verified: the first token (a route from prefill rank 0's)
        and the bytes of all routes. The first route to fail cancels the others and raises
        its `HandoffError`; the engine may free the blocks once this returns or raises."""
        waits = [asyncio.ensure_future(self._wait_route(request_id, route))
                 for route in self.routes]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_EXCEPTION)
            failed = next((w for w in waits if w.done() and w.exception() is not None), None)
            if failed is not None:
                raise failed.exception()  # type: ignore[misc]
            fences = [w.result() for w in waits]
        except BaseException:
            for wait in waits:
                wait.cancel()
            await self.cancel(request_id)
            raise
        # Prefill rank 0 alone samples: other ranks' fences carry a placeholder token.
        first = next(f for f, r in zip(fences, self.routes, strict=True) if r.sender_rank == 0)
        return dataclasses.replace(first, request_id=request_id,
                                   num_bytes=sum(f.num_bytes for f in fences),
                                   num_pieces=sum(f.num_pieces for f in fences))

    async def cancel(self, request_id: str) -> None:
        """Stop every route writing (returns once none can write any more)."""
        remote = []
        for route in self.routes:
            rid = self.route_id(request_id, route)
            if route.receiver_rank == 0:
                self.local.cancel(rid)
            else:
                remote.append(self._remote[route.receiver_rank].cancel(rid))
        # A dead rank writes nothing more: its failed cancel is not an error here.
        await asyncio.gather(*remote, return_exceptions=True)

    async def _wait_route(self, request_id: str, route: HeadRoute) -> FenceInfo:
        rid = self.route_id(request_id, route)
        if route.receiver_rank == 0:
            return await self.local.wait_ready_async(rid)
        try:
            return await self._remote[route.receiver_rank].wait_ready(rid)
        except HandoffError as exc:  # Ray's wrapper around the rank's own error
            cause = getattr(exc, "cause", None)
            raise (cause if isinstance(cause, HandoffError) else exc) from None
        except Exception as exc:  # noqa: BLE001 - the rank's actor died: the route is lost
            raise HandoffError(f"decode rank {route.receiver_rank} failed while receiving: "
                               f"{type(exc).__name__}") from exc
