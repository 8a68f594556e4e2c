"""deploy/compose files against the Compose Specification schema (check-jsonschema's vendored
copy, `vendor.compose-spec`), and the compose runner's variable interpolation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.integration.compose_local import ComposeError, interpolate

COMPOSE = Path(__file__).resolve().parents[2] / "deploy" / "compose"
FILES = [COMPOSE / "docker-compose.yml", COMPOSE / "compose.gpu.yaml"]


def test_files_match_the_compose_specification():
    tool = Path(sys.executable).parent / "check-jsonschema"
    done = subprocess.run([str(tool), "--builtin-schema", "vendor.compose-spec", *map(str, FILES)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_gpu_override_reserves_devices_for_rollout_and_trainer():
    gpu = yaml.safe_load(FILES[1].read_text())["services"]
    for name in ("rollout", "trainer"):
        (dev,) = gpu[name]["deploy"]["resources"]["reservations"]["devices"]
        assert dev["capabilities"] == ["gpu"] and dev["driver"] == "nvidia"
    base = yaml.safe_load(FILES[0].read_text())["services"]
    assert set(gpu) <= set(base)  # an override names only services the base file has


def test_interpolation_follows_compose():
    v = {"A": "1", "E": ""}
    assert interpolate("${A}-${B:-x}-${E:-y}-${E-z}", v) == "1-x-y-"
    with pytest.raises(ComposeError, match="B is missing: set B"):
        interpolate("${B:?set B}", v)
    with pytest.raises(ComposeError):
        interpolate("${E:?empty}", v)
