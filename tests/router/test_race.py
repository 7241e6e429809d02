"""`unless`: the work's result when it finishes first; cancelled work and `Overtaken` when the
stop event comes first; the work's own exception passes through."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router.race import Overtaken, unless


def test_the_work_finishing_first_gives_its_result() -> None:
    async def go() -> str:
        return await unless(asyncio.sleep(0.01, result="done"), asyncio.Event().wait())

    assert asyncio.run(go()) == "done"


def test_the_stop_coming_first_cancels_the_work() -> None:
    cancelled = asyncio.Event()

    async def work() -> str:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "late"

    async def go() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.01, stop.set)
        with pytest.raises(Overtaken):
            await unless(work(), stop.wait())
        assert cancelled.is_set()  # cancelled and awaited before unless returned

    asyncio.run(go())


def test_the_works_exception_passes_through() -> None:
    async def failing() -> None:
        raise ValueError("bad prompt")

    async def go() -> None:
        with pytest.raises(ValueError, match="bad prompt"):
            await unless(failing(), asyncio.Event().wait())

    asyncio.run(go())
