"""Warnings that are logged once per cause, for best-effort paths that may fail in a loop.

A best-effort step (an abort sent to a worker, a drain on shutdown, a heartbeat that does not
decode) must not fail its caller, but its failure must not vanish either. The first failure of
each cause is a warning; repeats of the same cause are debug lines, so a broken peer sending
a bad heartbeat every second does not flood the log.

    _warn = OncePerCause(log)
    except Exception as e:
        _warn(type(e).__name__, "abort of %s failed: %s", rid, e)
"""

from __future__ import annotations

import logging
from typing import Any

MAX_CAUSES = 256  # distinct causes remembered; beyond that every one is a warning again (bounded memory)


class OncePerCause:
    def __init__(self, log: logging.Logger):
        self.log = log
        self.seen: set[str] = set()

    def __call__(self, cause: str, msg: str, *args: Any) -> None:
        if cause in self.seen:
            self.log.debug(msg, *args)
            return
        if len(self.seen) < MAX_CAUSES:
            self.seen.add(cause)
        self.log.warning(msg, *args)
