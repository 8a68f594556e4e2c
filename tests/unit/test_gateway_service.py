"""Decoding sf.chat replies (services/gateway/service.py: decode_reply). Pure: no sockets."""

from __future__ import annotations

import pytest

from services.gateway.service import decode_reply
from shared.codec import encode
from shared.messages.chat import ChatDelta, ChatDone, ChatFailed, ToolCall, Usage


@pytest.mark.parametrize("reply", [
    ChatDelta("r", "hi", 3),
    ChatDelta("r", "", 0),
    ChatDone("r", "text", "tool_calls", Usage(1, 2), 4, [ToolCall("c", "f", "{}")], [1, 2], "s"),
    ChatFailed("r", 400, "context_length_exceeded", "too long"),
])
def test_every_reply_kind_round_trips(reply):
    # msgspec cannot decode the ChatReply union itself (array_like and map Structs mixed).
    assert decode_reply(encode(reply)) == reply


async def test_a_bad_worker_heartbeat_is_logged_once_and_a_good_one_is_kept(caplog):
    # bug 5: a heartbeat that did not decode was dropped without a word
    import logging
    import time
    import types

    from services.gateway import service as gw_service
    from services.gateway.config import GatewayConfig
    from shared.config import Connections
    from shared.messages.rollout import WorkerStatus

    caplog.set_level(logging.DEBUG, logger="shared.deadletter")
    gw = gw_service.Gateway(GatewayConfig(), Connections())
    for _ in range(3):
        await gw._on_worker_status(types.SimpleNamespace(subject="sf.rollout.status", data=b"\x93junk"))
    good = WorkerStatus("w0", "serving", 0, 0, 4, "m", 64, time.time())
    await gw._on_worker_status(types.SimpleNamespace(subject="sf.rollout.status", data=encode(good)))
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "malformed message" in r.message]
    assert len(warned) == 1 and [s.worker_id for s in gw.worker_table()] == ["w0"]
    assert gw.metrics.value("sf_bus_malformed_total", {"service": "gateway", "subject": "sf.rollout.status"}) == 3


async def test_a_session_op_a_dead_replica_held_is_sent_again(monkeypatch):
    # issue 14: a replica SIGKILLed while it held a session op never answers; the agent must not see it
    import types

    from services.gateway import service as gw_service
    from services.gateway.config import GatewayConfig
    from shared.bus import ReplyTimeout
    from shared.config import Connections
    from shared.messages.session import SessionReply, SessionRequest

    sent = []

    async def request(nc, subject, payload, timeout):
        sent.append(subject)
        if len(sent) == 1:
            raise ReplyTimeout("no reply")
        return encode(SessionReply(200, "s1"))

    monkeypatch.setattr(gw_service, "request", request)
    gw = gw_service.Gateway(GatewayConfig(resend_attempts=2), Connections())
    gw._nc = types.SimpleNamespace(is_connected=True)  # the edge faked here is `request`
    reply = await gw.session(SessionRequest(op="finish", session_id="s1", reward=1.0))
    assert reply.status == 200 and sent == ["sf.session.finish"] * 2

    sent.clear()

    async def silent(nc, subject, payload, timeout):
        sent.append(subject)
        raise ReplyTimeout("no reply")

    monkeypatch.setattr(gw_service, "request", silent)
    with pytest.raises(ReplyTimeout):
        await gw.session(SessionRequest(op="get", session_id="s1"))
    assert len(sent) == 3  # the first try and two re-sends, then the error
