"""The weight store's filesystem rules: atomic versions, checks before load, garbage collection."""

from __future__ import annotations

import pytest

from shared.weightstore import CheckpointError, check_checkpoint, collect_garbage, versions_on_disk, write_version


def test_write_check_and_gc(tiny_model, tmp_path):
    root = tmp_path / "store"
    for v in (1, 2, 3, 4):
        write_version(root, v, tiny_model)
    assert versions_on_disk(root) == [1, 2, 3, 4]
    with pytest.raises(FileExistsError):
        write_version(root, 4, tiny_model)
    check_checkpoint(root / "v000003")
    assert collect_garbage(root, in_use={1}, keep_latest=2) == [2]
    assert versions_on_disk(root) == [1, 3, 4]


def test_bad_checkpoints_are_refused_before_any_load(tiny_model, tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        check_checkpoint(tmp_path)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((tiny_model / "config.json").read_text())
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        check_checkpoint(bad)
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="header"):
        check_checkpoint(bad)
    with pytest.raises(CheckpointError):
        write_version(tmp_path / "store", 1, bad)
    assert versions_on_disk(tmp_path / "store") == []
