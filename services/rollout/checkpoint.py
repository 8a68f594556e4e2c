"""The model's EOS ids, read from its config files; the checkpoint checks themselves live in
shared/checkpoint.py (trainer, operator CLI and rollout workers use the same ones)."""

from __future__ import annotations

import json
from pathlib import Path

from shared.checkpoint import CheckpointError, TensorSpecs, check_checkpoint, tensor_specs

__all__ = ["CheckpointError", "TensorSpecs", "check_checkpoint", "eos_token_ids", "tensor_specs"]


def eos_token_ids(model_dir: str | Path) -> list[int]:
    """EOS ids from generation_config.json, else config.json (an int or a list in either)."""
    d = Path(model_dir)
    for name in ("generation_config.json", "config.json"):
        try:
            value = json.loads((d / name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, int):
            return [value]
        if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            return list(value)
    return []
