"""unless_disconnected: the work's result, or ClientGone once the client leaves, and a cancel from
elsewhere (shutdown) stays a cancel."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.edge import ClientGone, unless_disconnected


class FakeRequest:
    """What unless_disconnected reads of a Starlette request: receive(), which returns
    http.disconnect once `leave` is set (as an ASGI server does after the body)."""

    def __init__(self) -> None:
        self.leave = asyncio.Event()

    async def receive(self) -> dict:
        await self.leave.wait()
        return {"type": "http.disconnect"}


async def test_the_work_result_when_the_client_stays():
    req, gone = FakeRequest(), []

    async def work() -> int:
        await asyncio.sleep(0.01)
        return 7

    async def on_gone() -> None:
        gone.append(True)

    assert await unless_disconnected(req, work(), on_gone) == 7
    assert gone == []
    req.leave.set()  # a disconnect after the work ended cancels nothing
    await asyncio.sleep(0.01)
    assert asyncio.current_task().cancelling() == 0


async def test_a_disconnect_cancels_the_work_and_raises_client_gone():
    req, events = FakeRequest(), []

    async def work() -> int:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            events.append("work cancelled")
            raise
        return 7

    async def on_gone() -> None:
        events.append("on_gone")

    asyncio.get_running_loop().call_later(0.02, req.leave.set)
    with pytest.raises(ClientGone):
        await unless_disconnected(req, work(), on_gone)
    assert events == ["work cancelled", "on_gone"]
    assert asyncio.current_task().cancelling() == 0  # the watcher's cancel was taken back
    await asyncio.sleep(0)  # and nothing is left pending on this task


async def test_a_cancel_from_elsewhere_is_a_cancel_not_client_gone():
    req, gone = FakeRequest(), []

    async def on_gone() -> None:
        gone.append(True)

    async def turn() -> None:
        await unless_disconnected(req, asyncio.sleep(10), on_gone)

    task = asyncio.create_task(turn())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gone == []


async def test_work_that_swallows_the_cancel_still_gives_its_result():
    req = FakeRequest()

    async def stubborn() -> int:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            return 3  # a generator's cleanup that answers anyway
        return 7

    async def on_gone() -> None:
        raise AssertionError("the work answered: the client is not reported gone")

    asyncio.get_running_loop().call_later(0.02, req.leave.set)
    assert await unless_disconnected(req, stubborn(), on_gone) == 3
    assert asyncio.current_task().cancelling() == 0


async def test_a_failed_receive_counts_as_the_client_gone():
    class Broken(FakeRequest):
        async def receive(self) -> dict:
            await asyncio.sleep(0.02)
            raise RuntimeError("the connection broke")

    gone = []

    async def on_gone() -> None:
        gone.append(True)

    with pytest.raises(ClientGone):
        await unless_disconnected(Broken(), asyncio.sleep(10), on_gone)
    assert gone == [True] and asyncio.current_task().cancelling() == 0
