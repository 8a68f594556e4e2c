"""The weight store: published policy versions as HF safetensors snapshots on a filesystem.

    <root>/v000001/{config.json, model.safetensors, ...}

This is the shared-disk path (SF_TRAINER_WEIGHTS_TRANSPORT=disk). Over the network
(`network`) no version dir is written: the announcement carries a transfer round instead
(shared/weightxfer.py), and checkpoints stay files for resume and export only.

`root` is a local dir on one machine or a shared filesystem (NFS, Lustre, a mounted bucket)
across machines: every rollout host must read the same path. A version is written to a
temporary dir and renamed into place, so a reader never sees half a snapshot; only then is
`WeightsPublished` announced on the WEIGHTS stream (last value per subject, so a worker that
starts late reads the current version). Trainer and operator CLI share this module.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from pathlib import Path

import msgspec
from nats.js import JetStreamContext

from shared import bus, subjects
from shared.codec import decode
from shared.checkpoint import CheckpointError, check_checkpoint
from shared.logonce import OncePerCause
from shared.messages import WeightsPublished
from shared.messages.weights import WeightTransfer

log = logging.getLogger(__name__)
_warn = OncePerCause(log)

__all__ = ["CheckpointError", "check_checkpoint", "write_version", "versions_on_disk",
           "version_dir", "current", "announce", "publish_dir", "collect_garbage"]

_VERSION_DIR = re.compile(r"^v(\d{6,})$")




def version_dir(root: Path, version: int) -> Path:
    return Path(root) / f"v{version:06d}"


def version_of(path: str | Path) -> int | None:
    """The version a store dir holds (`<root>/v000007` -> 7); None for any other directory."""
    m = _VERSION_DIR.match(Path(path).name)
    return int(m.group(1)) if m else None


def versions_on_disk(root: Path) -> list[int]:
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _VERSION_DIR.match(p.name)) and p.is_dir())


def write_version(root: Path, version: int, src: Path) -> Path:
    """Copy an HF snapshot dir into the store as `version`, atomically."""
    check_checkpoint(src)
    dest = version_dir(root, version)
    if dest.exists():
        raise FileExistsError(f"version {version} already exists at {dest}")
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    tmp.rename(dest)
    return dest


async def current(js: JetStreamContext) -> WeightsPublished | None:
    """The newest WeightsPublished; None if there is none, or the newest is unreadable (someone published
    garbage: followers dead-letter it on its push; a trainer still starts, and its next announce replaces it)."""
    data = await bus.last_value(js, "WEIGHTS", subjects.WEIGHTS_PUBLISHED)
    if not data:
        return None
    try:
        return decode(data, WeightsPublished)
    except msgspec.DecodeError as e:
        _warn(f"weights-last:{type(e).__name__}", "the WEIGHTS stream's last value is not a WeightsPublished "
              "(%s); taken as no version announced", e)
        return None


async def announce(js: JetStreamContext, version: int, path: Path | None, step: int = 0,
                   retry_for: float = 0.0, transfer: WeightTransfer | None = None) -> WeightsPublished:
    """Publish `version` on the WEIGHTS stream; `retry_for` seconds of retries while NATS is away.
    Over the network `path` is None and `transfer` names the round (shared/weightxfer.py)."""
    event = WeightsPublished(version=version, path=str(Path(path).resolve()) if path is not None else "",
                             published_at=time.time(), step=step, transfer=transfer)
    await bus.publish_durable(js, subjects.WEIGHTS_PUBLISHED, event, msg_id=f"weights-v{version}",
                              retry_for=retry_for)
    return event


async def publish_dir(js: JetStreamContext, root: Path, src: Path, step: int = 0) -> WeightsPublished:
    """Operator path (`seamlessflow weights publish DIR`): next version = current + 1."""
    await bus.ensure_streams(js, subjects.STREAMS)
    cur = await current(js)
    on_disk = versions_on_disk(root)
    version = max([cur.version if cur else 0, *on_disk]) + 1
    dest = write_version(root, version, src)
    return await announce(js, version, dest, step)


def collect_garbage(root: Path, in_use: set[int], keep_latest: int = 2) -> list[int]:
    """Delete versions no worker serves, always keeping the newest `keep_latest`."""
    versions = versions_on_disk(root)
    keep = set(versions[-keep_latest:]) | in_use
    removed = []
    for v in versions:
        if v not in keep:
            shutil.rmtree(version_dir(root, v), ignore_errors=True)
            removed.append(v)
    return removed
