"""A module-scoped SeamlessFlow stack on free ports, against the session's NATS and Redis."""

from __future__ import annotations

from pathlib import Path

from seamlessflow import servers
from seamlessflow.stack import Stack, StackOptions


def make_stack(tmp: Path, model: Path, nats_url: str, redis_url: str, **kw) -> Stack:
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
        **kw,
    )
    stack = Stack(opts)
    stack.start()
    return stack
