"""cProfile on demand, for every Python process started with this folder on PYTHONPATH
(bench/gateway_overhead.py --profile DIR puts it there and sets SF_PROFILE_DIR).

A process whose `-m` module is listed in SF_PROFILE_ONLY (comma-separated) starts profiling on
SIGUSR1 and writes SF_PROFILE_DIR/<module>-<pid>-<n>.prof on SIGUSR2, so a profile covers the
measured turns only, not start-up. Read one with

    .venv/bin/python -m pstats DIR/services.trajectory-123-1.prof    # then: sort tottime / stats 30
"""

import os
import signal
import sys

_dir = os.environ.get("SF_PROFILE_DIR")
_only = [m for m in os.environ.get("SF_PROFILE_ONLY", "").split(",") if m]


def _module() -> str:
    argv = getattr(sys, "orig_argv", sys.argv)
    return argv[argv.index("-m") + 1] if "-m" in argv[:-1] else ""


if _dir and _module() in _only:
    import cProfile

    import time

    _state = {"prof": None, "n": 0}

    def _start(signum, frame) -> None:
        _state["prof"] = cProfile.Profile(time.thread_time)  # CPU of the event loop thread, not wall time
        _state["prof"].enable()

    def _stop(signum, frame) -> None:
        prof = _state["prof"]
        if prof is not None:
            prof.disable()
            _state["n"] += 1
            prof.dump_stats(os.path.join(_dir, f"{_module()}-{os.getpid()}-{_state['n']}.prof"))
            _state["prof"] = None

    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
