"""services/trajectory/turnstream.py: what the agent sees of a turn, and what is persisted when."""

from __future__ import annotations

import pytest

from services.trajectory.rendering import Renderer
from services.trajectory.turnstream import PERSIST_CHUNK, PROGRESS_INTERVAL, TurnStream
from shared.messages import ChatRequest, Sampling, TokenDelta


@pytest.fixture(scope="module")
def renderer(tiny_model):
    return Renderer.from_pretrained(str(tiny_model))


def req(**kw) -> ChatRequest:
    return ChatRequest("r", "s", "chat", "m", Sampling(), messages=[{"role": "user", "content": "x"}], **kw)


def feed(stream: TurnStream, renderer, text: str, now: float = 0.0, worker: str = "w0"):
    shown, keep = [], None
    for k, t in enumerate(renderer.encode(text)):
        keep = stream.add(TokenDelta("r", [t], [-0.1], 0), worker, first=k == 0)
        stream.to_persist(first=k == 0)
        if (piece := stream.progress(now)) is not None:
            shown.append(piece)
        if keep is not None:
            break
    return shown, keep


def test_a_stream_shows_text_as_it_comes_with_offsets(renderer):
    s = TurnStream(renderer, req(), now=0.0)
    shown, _ = feed(s, renderer, "hello big world")
    assert "".join(p for p, _ in shown) == "hello big world"
    assert [o for _, o in shown] == [sum(len(p) for p, _ in shown[:i]) for i in range(len(shown))]
    assert "".join(p for p, _ in shown) == s.final_text()  # nothing left for the ChatDone to complete


def test_a_stop_string_cuts_the_text_and_the_tokens_and_is_never_shown(renderer):
    s = TurnStream(renderer, req(stop=["END"]), now=0.0)
    shown, keep = feed(s, renderer, "one two END three")
    assert keep is not None and s.stopped and s.final_text() == "one two "
    assert "E" not in "".join(p for p, _ in shown)  # a possible stop start is held back
    assert "one two ".startswith("".join(p for p, _ in shown))  # the ChatDone completes it (the gateway)


def test_tool_calls_are_held_back(renderer):
    s = TurnStream(renderer, req(tools=[{"type": "function", "function": {"name": "f"}}]), now=0.0)
    shown, _ = feed(s, renderer, 'ok <tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert "<tool" not in "".join(p for p, _ in shown)


def test_a_plain_request_persists_in_chunks_and_shows_progress_now_and_then(renderer):
    s = TurnStream(renderer, req(agent_streams=False), now=0.0)
    first = s.add(TokenDelta("r", [5], [-0.1], 0), "w0", first=True)
    assert first is None and len(s.to_persist(first=True)) == 1  # a dispatch's first delta: at once
    for _ in range(PERSIST_CHUNK - 1):
        s.add(TokenDelta("r", [5], [-0.1], 0), "w0", first=False)
        assert s.to_persist(first=False) == []
    s.add(TokenDelta("r", [5], [-0.1], 0), "w0", first=False)
    assert sum(len(r.token_ids) for r in s.to_persist(first=False)) == PERSIST_CHUNK
    assert s.progress(PROGRESS_INTERVAL / 2) is None
    assert s.progress(PROGRESS_INTERVAL + 0.01) is not None


def test_a_stream_persists_every_delta(renderer):
    s = TurnStream(renderer, req(), now=0.0)
    for k in range(3):
        s.add(TokenDelta("r", [5], [-0.1], 0), "w0", first=k == 0)
        assert len(s.to_persist(first=k == 0)) == 1


def test_replayed_tokens_may_already_hold_the_stop_string(renderer):
    s = TurnStream(renderer, req(stop=["END"]), now=0.0)
    s.replay(renderer.encode("done END"))
    assert s.stopped and s.final_text() == "done "
