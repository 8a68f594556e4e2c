"""The record of what was trained: an append-only JSONL audit log, and the checkpoint's own ledger.

    {"event": "step", "step": 7, "version": 7, "ids": ["s1", ...], "ts": ...}
    {"event": "checkpoint", "step": 8, "tag": "step-00000008", "ts": ...}
    {"event": "resume", "step": 6, "ts": ...}

Rank 0 appends a `step` line right after each step trains. A crash loses the
steps after the last checkpoint: the weights go back to it, and their
trajectories are trained again. The `resume` line the restarted trainer writes
says so, and `trained_steps()` drops the lost steps, so the log reads as the
history of the weights that exist. The checkpoint's ledger (`checkpoint_ledger`)
is the same record as DeepSpeed saved it, bounded by `ledger_keep_steps`.

It does not know NATS or the engine; `checkpoint_ledger` only reads DeepSpeed's files.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

CLIENT_KEY = "seamlessflow"  # engine.CLIENT_KEY; repeated so reading needs no DeepSpeed import


class AuditLog:
    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def _append(self, record: dict) -> None:
        if self.path is None:
            return
        line = json.dumps({**record, "ts": round(time.time(), 3)}) + "\n"
        # one write per line: a SIGKILL leaves at most a torn last line, which readers skip
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def step(self, step: int, version: int, ids: list[str]) -> None:
        self._append({"event": "step", "step": step, "version": version, "ids": ids})

    def checkpoint(self, step: int, tag: str) -> None:
        self._append({"event": "checkpoint", "step": step, "tag": tag})

    def resume(self, step: int) -> None:
        self._append({"event": "resume", "step": step})


def read(path: str | Path) -> list[dict]:
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a torn last line from a kill
    return out


def trained_steps(records: list[dict]) -> dict[int, list[str]]:
    """step -> ids, for the steps whose weights survive: a `resume` at S forgets every earlier step > S."""
    steps: dict[int, list[str]] = {}
    for r in records:
        if r.get("event") == "step":
            steps[int(r["step"])] = list(r["ids"])
        elif r.get("event") == "resume":
            for s in [s for s in steps if s > int(r["step"])]:
                del steps[s]
    return dict(sorted(steps.items()))


def latest_checkpoint(root: str | Path) -> Path | None:
    root = Path(root)
    latest = root / "latest"
    if not latest.is_file():
        return None
    return root / latest.read_text().strip()


def checkpoint_client_state(root: str | Path) -> dict | None:
    """The client state (step, version, ledger) of the newest checkpoint under `root`, read from disk."""
    import torch

    tag = latest_checkpoint(root)
    if tag is None:
        return None
    files = sorted(tag.glob("mp_rank_*_model_states.pt")) or sorted(tag.glob("zero_pp_rank_0_mp_rank_*_model_states.pt"))
    if not files:
        raise FileNotFoundError(f"no model states file in {tag}")
    state = torch.load(files[0], map_location="cpu", weights_only=False)
    return state.get(CLIENT_KEY, {})


def checkpoint_ledger(root: str | Path) -> dict[int, list[str]]:
    """step -> trained ids, as the newest checkpoint's ledger holds them."""
    client = checkpoint_client_state(root) or {}
    trained = client.get("ledger", {}).get("trained", {})
    return {int(k): list(v) for k, v in sorted(trained.items(), key=lambda kv: int(kv[0]))}
