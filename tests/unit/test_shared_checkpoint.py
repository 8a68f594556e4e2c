"""shared/checkpoint.py (and services/rollout/sampling.py: eos_token_ids): weight dirs are judged from their headers, before vLLM sees them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from services.rollout.sampling import eos_token_ids
from shared.checkpoint import CheckpointError, check_checkpoint, tensor_specs


def write_ckpt(d: Path, tensors: dict[str, np.ndarray] | None = None, config: dict | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config or {"model_type": "llama", "eos_token_id": 2}))
    tensors = tensors or {"embed.weight": np.zeros((8, 4), np.float32), "norm.weight": np.ones(4, np.float32)}
    save_file(tensors, str(d / "model.safetensors"))
    return d


def test_good_dir_gives_specs(tmp_path):
    specs = check_checkpoint(write_ckpt(tmp_path / "a"))
    assert specs == {"embed.weight": ("F32", (8, 4)), "norm.weight": ("F32", (4,))}


def test_same_shapes_other_dtype_passes(tmp_path):
    ref = tensor_specs(write_ckpt(tmp_path / "a"))
    bf = {"embed.weight": np.zeros((8, 4), np.float16), "norm.weight": np.ones(4, np.float16), "extra": np.ones(1)}
    check_checkpoint(write_ckpt(tmp_path / "b", bf), ref)


@pytest.mark.parametrize("damage, words", [
    (lambda d: (d / "config.json").unlink(), "config.json"),
    (lambda d: (d / "config.json").write_text("{not json"), "config.json"),
    (lambda d: (d / "model.safetensors").unlink(), r"no \*\.safetensors"),
    (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:-5]), "truncated"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\x05\x00"), "shorter"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 8 + b"{}"), "does not fit"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\x04" + b"\x00" * 7 + b"nope"), "bad header"),
])
def test_damaged_dir_is_rejected(tmp_path, damage, words):
    d = write_ckpt(tmp_path / "a")
    damage(d)
    with pytest.raises(CheckpointError, match=words):
        check_checkpoint(d)


def test_missing_dir_is_rejected(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        check_checkpoint(tmp_path / "nope")


def test_shape_or_name_mismatch_with_reference_is_rejected(tmp_path):
    ref = tensor_specs(write_ckpt(tmp_path / "a"))
    norm = np.ones(4, np.float32)
    wrong = write_ckpt(tmp_path / "b", {"embed.weight": np.zeros((9, 4), np.float32), "norm.weight": norm})
    with pytest.raises(CheckpointError, match="shape"):
        check_checkpoint(wrong, ref)
    renamed = write_ckpt(tmp_path / "c", {"emb.weight": np.zeros((8, 4), np.float32), "norm.weight": norm})
    with pytest.raises(CheckpointError, match="missing tensors"):
        check_checkpoint(renamed, ref)


def test_eos_from_generation_config_then_config(tmp_path):
    d = write_ckpt(tmp_path / "a", config={"eos_token_id": 7})
    assert eos_token_ids(d) == [7]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 4]}))
    assert eos_token_ids(d) == [3, 4]
    assert eos_token_ids(write_ckpt(tmp_path / "b", config={"model_type": "llama"})) == []
