"""shared/deadletter.py without a server: subject matching, the dead letter's headers, the counter,
log-once, and the order copy-then-term (nak when the copy fails). The NATS client and JetStream
context are stand-ins; the module's code stays real."""

from __future__ import annotations

import asyncio
import logging

import pytest
from nats.aio.msg import Msg

from seamlessflow.ops.dead import format_letters, to_json
from shared import deadletter, subjects
from shared.codec import decode, encode
from shared.deadletter import DeadLetter, Malformed
from shared.messages import ChatCancel, ChatFailed

ACK = "$JS.ACK.TRAJECTORIES.trainer.1.42.7.1700000000000000000.0"


class FakeClient:
    def __init__(self):
        self.published: list[tuple[str, bytes]] = []

    async def publish(self, subject, data=b"", **kw):
        self.published.append((subject, data))


class FakeJS:
    def __init__(self, fail: int = 0):
        self.fail = fail  # this many publishes fail before one succeeds
        self.stored: list[tuple[str, bytes, dict]] = []

    async def publish(self, subject, data, timeout, headers):
        if self.fail:
            self.fail -= 1
            raise TimeoutError("no PubAck")
        self.stored.append((subject, data, headers))


def msg(subject: str, data: bytes, reply: str = "", client=None) -> Msg:
    return Msg(_client=client or FakeClient(), subject=subject, reply=reply, data=data)


def attached(service: str, js: FakeJS) -> Malformed:
    m = Malformed(service)
    m.js, m.streams = js, subjects.streams()
    return m


def test_subject_patterns_and_what_the_streams_store():
    assert deadletter.matches("sf.rollout.gen.*", "sf.rollout.gen.w0")
    assert not deadletter.matches("sf.rollout.gen.*", "sf.rollout.gen.w0.x")
    assert deadletter.matches("sf.dead.>", "sf.dead.trainer.sf.traj.completed")
    assert not deadletter.matches("sf.dead.>", "sf.dead")
    streams = subjects.streams()
    assert deadletter.DEAD_STREAM in [s.name for s in streams]
    for stored in (subjects.TRAJ_COMPLETED, subjects.WEIGHTS_PUBLISHED, subjects.sched_assign("h0")):
        assert deadletter.stored(stored, streams)
    for core in (subjects.CHAT, subjects.ROLLOUT_STATUS, subjects.session_op("create"), "sf.dead.x.y"):
        assert not deadletter.stored(core, streams)


def test_error_text_is_one_line_and_bounded():
    text = deadletter.error_text(ValueError("line one\nline two " + "x" * 1000))
    assert "\n" not in text and text.startswith("ValueError: line one line two")
    assert len(text) == deadletter.MAX_ERROR and text.endswith("...")


def test_headers_name_the_original_and_deduplicate():
    d = msg(subjects.TRAJ_COMPLETED, b"\xc1", ACK)
    h = deadletter.headers("trainer", d, ValueError("bad"), 1700000000.5)
    assert h[deadletter.H_SUBJECT] == subjects.TRAJ_COMPLETED and h[deadletter.H_SERVICE] == "trainer"
    assert h[deadletter.H_ERROR] == "ValueError: bad" and h[deadletter.H_TIME] == "1700000000.500"
    assert h[deadletter.H_SEQ] == "42" and h["Nats-Msg-Id"].endswith("seq 42")  # a redelivery is stored once
    core = [deadletter.headers("rollout", msg(subjects.WEIGHTS_PUBLISHED, data), ValueError("x"), 1.0)
            for data in (b"a", b"a", b"b")]
    assert core[0]["Nats-Msg-Id"] == core[1]["Nats-Msg-Id"] != core[2]["Nats-Msg-Id"]  # every replica: once
    assert deadletter.H_SEQ not in core[0]


async def test_counted_per_pattern_logged_once_and_core_messages_only_counted(caplog):
    js = FakeJS()
    m = attached("rollout", js)
    caplog.set_level(logging.DEBUG, logger="shared.deadletter")
    for wid in ("w0", "w1", "w2"):
        m(msg(subjects.rollout_gen(wid), b"\xc1garbage"), subjects.rollout_gen("*"), ValueError("undecodable"))
    assert m.count(subjects.rollout_gen("*")) == 3  # one label for every worker id
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "dropped" in warnings[0].getMessage()
    assert not m.tasks and not js.stored  # core NATS keeps nothing: nothing to dead-letter


async def test_a_delivery_is_copied_then_terminated():
    js, client = FakeJS(), FakeClient()
    m = attached("trainer", js)
    m(msg(subjects.TRAJ_COMPLETED, b"\x93\x01\x02", ACK, client), subjects.TRAJ_COMPLETED, ValueError("wrong type"))
    await m.drain()
    [(subject, data, hdrs)] = js.stored
    assert subject == "sf.dead.trainer.sf.traj.completed" and data == b"\x93\x01\x02"
    assert client.published == [(ACK, b"+TERM")]  # only after the copy was stored


async def test_a_copy_that_fails_naks_the_delivery_instead(monkeypatch):
    js, client = FakeJS(fail=deadletter.PUBLISH_TRIES), FakeClient()
    m = attached("trainer", js)
    monkeypatch.setattr(asyncio, "sleep", _no_sleep)
    m(msg(subjects.TRAJ_COMPLETED, b"x", ACK, client), subjects.TRAJ_COMPLETED, ValueError("bad"))
    await asyncio.wait_for(m.drain(), 5)
    assert not js.stored
    [(subject, payload)] = client.published
    assert subject == ACK and payload.startswith(b"-NAK")  # it comes back later, to be copied again


async def _no_sleep(_s):
    return None


async def test_a_stored_subjects_core_message_is_copied_without_an_ack():
    js, client = FakeJS(), FakeClient()
    m = attached("trajectory", js)
    m(msg(subjects.WEIGHTS_PUBLISHED, b"{}", client=client), subjects.WEIGHTS_PUBLISHED, ValueError("x"))
    await m.drain()
    assert [s for s, _, _ in js.stored] == ["sf.dead.trajectory.sf.weights.published"]
    assert client.published == []


async def test_copies_in_flight_are_bounded(monkeypatch):
    monkeypatch.setattr(deadletter, "MAX_IN_FLIGHT", 2)
    gate = asyncio.Event()

    class SlowJS(FakeJS):
        async def publish(self, *a, **kw):
            await gate.wait()

    m = attached("trajectory", SlowJS())
    for _ in range(5):
        m(msg(subjects.WEIGHTS_PUBLISHED, b"x"), subjects.WEIGHTS_PUBLISHED, ValueError("x"))
    assert len(m.tasks) == 2 and m.count(subjects.WEIGHTS_PUBLISHED) == 5  # all counted, two copied
    gate.set()
    await m.drain()


# -- Malformed.decode: what every subscription calls -------------------------------------------------

def refused(why: str) -> ChatFailed:
    return ChatFailed("", 400, "invalid_request", why)


async def test_decode_gives_the_message_and_counts_nothing():
    m = attached("trajectory", FakeJS())
    got = m.decode(msg(subjects.CHAT_CANCEL, encode(ChatCancel("r1"))), ChatCancel, subjects.CHAT_CANCEL)
    assert got == ChatCancel("r1") and m.count(subjects.CHAT_CANCEL) == 0 and not m.tasks


@pytest.mark.parametrize("bad", [b"\xc1", encode(ChatFailed("r", 1, "c", "m"))], ids=["undecodable", "another type"])
async def test_decode_counts_logs_once_and_refuses_a_request(caplog, bad):
    m, client = attached("trajectory", FakeJS()), FakeClient()
    caplog.set_level(logging.DEBUG, logger="shared.deadletter")
    for _ in range(2):
        assert m.decode(msg(subjects.CHAT, bad, "_INBOX.1", client), ChatCancel, subjects.CHAT, refuse=refused) is None
    await m.drain()
    assert m.count(subjects.CHAT) == 2
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    assert [s for s, _ in client.published] == ["_INBOX.1"] * 2
    reply = decode(client.published[0][1], ChatFailed)
    assert reply.status == 400 and reply.code == "invalid_request" and reply.message  # the decoder's words


async def test_decode_refuses_only_where_asked_and_answerable():
    m, client = attached("trajectory", FakeJS()), FakeClient()
    assert m.decode(msg(subjects.CHAT, b"\xc1", "", client), ChatCancel, subjects.CHAT, refuse=refused) is None
    assert m.decode(msg(subjects.CHAT, b"\xc1", "_INBOX.2", client), ChatCancel, subjects.CHAT) is None
    await m.drain()
    assert client.published == [] and m.count(subjects.CHAT) == 2  # no inbox, or an event: counted only


async def test_a_refusal_that_cannot_be_sent_is_logged_not_raised(caplog):
    class Closed(FakeClient):
        async def publish(self, subject, data=b"", **kw):
            raise ConnectionError("closed")

    m = attached("scheduler", FakeJS())
    caplog.set_level(logging.WARNING, logger="shared.deadletter")
    assert m.decode(msg(subjects.SCHED_CTL, b"\xc1", "_INBOX.3", Closed()), ChatCancel, subjects.SCHED_CTL,
                    refuse=refused) is None
    await m.drain()
    assert any("answering a malformed request" in r.getMessage() for r in caplog.records)


async def test_decode_check_refuses_a_valid_message_like_a_bad_one():
    def check(c: ChatCancel) -> None:
        if not c.request_id:
            raise ValueError("no request id")

    js, client = FakeJS(), FakeClient()
    m = attached("trainer", js)
    ok = msg(subjects.TRAJ_COMPLETED, encode(ChatCancel("r")), ACK, client)
    assert m.decode(ok, ChatCancel, subjects.TRAJ_COMPLETED, check=check) == ChatCancel("r")
    bad = msg(subjects.TRAJ_COMPLETED, encode(ChatCancel("")), ACK, client)
    assert m.decode(bad, ChatCancel, subjects.TRAJ_COMPLETED, check=check) is None
    await m.drain()
    [(_, _, hdrs)] = js.stored  # a stored delivery: dead-lettered, then terminated, as `__call__` does
    assert hdrs[deadletter.H_ERROR] == "ValueError: no request id"
    assert client.published == [(ACK, b"+TERM")] and m.count(subjects.TRAJ_COMPLETED) == 1


def test_the_cli_formats():
    letters = [DeadLetter(3, 1700000000.0, "trainer", subjects.TRAJ_COMPLETED, "DecodeError: " + "y" * 200, 17)]
    text = format_letters(letters)
    assert "trainer" in text and subjects.TRAJ_COMPLETED in text and "17" in text and text.endswith("...")
    assert '"service":"trainer"' in to_json(letters)
    assert format_letters([]) == "no dead letters"


@pytest.mark.parametrize("bad", [b"\xc1", b"\x00\x01", b'{"op": 1}', b""])
def test_every_kind_of_garbage_is_a_decode_error(bad):
    """The services catch msgspec.DecodeError: it covers undecodable bytes and another type alike."""
    import msgspec

    from shared.messages import ChatRequest

    with pytest.raises(msgspec.DecodeError):
        decode(bad, ChatRequest)
    assert issubclass(msgspec.ValidationError, msgspec.DecodeError)
