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
