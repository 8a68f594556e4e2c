"""services/gateway/errors.py: what the failures behind the gateway become for the agent."""

from __future__ import annotations

import pytest

from services.gateway.errors import StoreBusy, StoreUnavailable, from_exception
from shared.bus import BusUnavailable, NoResponders


def test_no_responders_is_told_by_its_type_not_its_words():
    e = from_exception(NoResponders("sf.chat"))
    assert (e.status, e.code) == (503, "trajectory_unavailable") and "sf.chat" in e.message
    e = from_exception(BusUnavailable("nobody serves sf.chat"))  # the same words, the other type
    assert (e.status, e.code) == (503, "nats_unavailable")


@pytest.mark.parametrize("down,code", [
    (NoResponders("sf.chat"), "trajectory_unavailable"),
    (BusUnavailable("not connected to NATS"), "nats_unavailable"),
    (StoreUnavailable("key lookup failed"), "redis_unavailable"),
    (StoreBusy("key lookup failed"), "overloaded"),
])
def test_every_503_says_when_to_retry(down, code):
    e = from_exception(down)
    assert (e.status, e.code) == (503, code)
    assert e.response().headers["retry-after"] == "1"
