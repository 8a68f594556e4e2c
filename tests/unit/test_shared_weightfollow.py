"""shared/weightfollow.py: the newest of the pushed and polled WeightsPublished events is used."""

import asyncio

from shared import weightfollow
from shared.messages import WeightsPublished


def ev(v: int) -> WeightsPublished:
    return WeightsPublished(version=v, path=f"/w/v{v}", published_at=0.0)


def test_newest_picks_the_highest_version_and_ignores_unknowns():
    assert weightfollow.newest() is None and weightfollow.newest(None) is None
    assert weightfollow.newest(ev(3), None, ev(5), ev(4)).version == 5


class FakeMsg:
    def __init__(self, data: bytes):
        self.data = data


class FakeSub:
    async def unsubscribe(self):
        pass


class FakeNC:
    """Only the edge is faked: a subscription callback and the WEIGHTS stream's last value."""

    def __init__(self, last: WeightsPublished | None):
        self.last, self.cb = last, None

    async def subscribe(self, subject, cb):
        self.cb = cb
        return FakeSub()

    def jetstream(self):
        return self


async def test_a_push_newer_than_the_stream_is_used_at_once(monkeypatch):
    from shared.codec import encode

    nc = FakeNC(ev(1))

    async def current(js):
        return js.last

    monkeypatch.setattr(weightfollow.weightstore, "current", current)
    seen: list[int] = []
    got_two = asyncio.Event()

    async def on_newest(e):
        seen.append(e.version)
        if e.version == 2:
            got_two.set()

    task = asyncio.create_task(weightfollow.WeightFollower(nc, on_newest, poll=60).run())
    try:
        while nc.cb is None or not seen:
            await asyncio.sleep(0.01)
        await nc.cb(FakeMsg(encode(ev(2))))  # the stream's last value still says 1
        await asyncio.wait_for(got_two.wait(), 2)  # long before the 60 s poll
        await nc.cb(FakeMsg(b"\x00garbage"))  # a bad event is ignored, not fatal
        await asyncio.sleep(0.05)
        assert seen[0] == 1 and seen[-1] == 2 and not task.done()
    finally:
        task.cancel()
