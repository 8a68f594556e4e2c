"""shared/logonce.py: the first failure of each cause is a warning, repeats are debug lines."""

import logging

from shared import logonce


def test_warns_once_per_cause(caplog):
    log = logging.getLogger("test.logonce")
    caplog.set_level(logging.DEBUG, logger="test.logonce")
    warn = logonce.OncePerCause(log)
    for _ in range(3):
        warn("a", "cause a: %s", 1)
    warn("b", "cause b")
    levels = [(r.levelno, r.message) for r in caplog.records]
    assert levels == [(logging.WARNING, "cause a: 1"), (logging.DEBUG, "cause a: 1"),
                      (logging.DEBUG, "cause a: 1"), (logging.WARNING, "cause b")]


def test_memory_is_bounded(monkeypatch):
    monkeypatch.setattr(logonce, "MAX_CAUSES", 2)
    warn = logonce.OncePerCause(logging.getLogger("test.logonce"))
    for c in "abcdef":
        warn(c, "x")
    assert warn.seen == {"a", "b"}
