"""A module-scoped SeamlessFlow stack on free ports, against the session's NATS and Redis."""

from __future__ import annotations

import sys
from pathlib import Path

from seamlessflow.stack import Stack, StackOptions, servers


def simulated_worker_cmd(step_ms: float = 10.0, capacity: int = 16, start_s: float = 0.0) -> str:
    """The SIMULATED engine inside the real rollout worker (services/rollout/simulated.py): for tests
    whose subject is not vLLM (supervision, admission, the status page). It starts in about a
    second (or after `start_s`, standing for an engine's load time) instead of vLLM-CPU's 20 s
    to minutes, and generates `max_tokens` ordinary tokens."""
    return (f"{sys.executable} -m services.rollout.simulated --step-ms {step_ms} --capacity {capacity} "
            f"--start-s {start_s}")


def make_stack(tmp: Path, model: Path, nats_url: str, redis_url: str, simulated: bool = False, **kw) -> Stack:
    opts = StackOptions(
        model=model,
        data_dir=tmp,
        gateway_port=servers.free_port(),
        admin_port=servers.free_port(),
        external_nats=nats_url,
        external_redis=redis_url,
        max_model_len=kw.pop("max_model_len", 512),
        max_num_seqs=kw.pop("max_num_seqs", 8),
        # a vLLM-CPU engine starts in ~20 s on a quiet box; a fresh clone on a loaded one took 240+
        ready_timeout=kw.pop("ready_timeout", 420),
        worker_cmd=simulated_worker_cmd() if simulated else "",
        **kw,
    )
    stack = Stack(opts)
    stack.start()
    return stack
