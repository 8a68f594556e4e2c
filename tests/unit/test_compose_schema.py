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
FILES = [COMPOSE / "docker-compose.yml", COMPOSE / "compose.gpu.yaml", COMPOSE / "compose.ha.yaml",
         COMPOSE / "compose.tls.yaml"]


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


def test_ha_override_gives_every_service_the_cluster_and_sentinel_urls():
    ha = yaml.safe_load(FILES[2].read_text())["services"]
    base = yaml.safe_load(FILES[0].read_text())["services"]
    assert {"scheduler", "host-trainer"} <= set(base)
    for name, svc in base.items():
        if "SF_NATS_URL" in (svc.get("environment") or {}):
            env = ha[name]["environment"]
            assert env["SF_NATS_URL"].count("nats://") == 3 and env["SF_JETSTREAM_REPLICAS"] == "3", name
            assert env["SF_REDIS_URL"].startswith("redis+sentinel://"), name
    assert {"nats-2", "nats-3", "redis-replica", "sentinel-1", "sentinel-2", "sentinel-3"} <= set(ha)


def test_tls_override_gives_every_service_the_tls_settings_and_the_servers_their_certificates():
    tls = yaml.safe_load(FILES[3].read_text())["services"]
    base = yaml.safe_load(FILES[0].read_text())["services"]
    for name, svc in base.items():
        env = svc.get("environment") or {}
        if "SF_NATS_URL" in env:
            over = tls[name]["environment"]
            # the override repeats what the base sets, so the file reads whole on its own
            assert set(env) <= set(over), (name, set(env) - set(over))
            for k in ("SF_NATS_TLS_CA", "SF_NATS_TLS_CERT", "SF_NATS_TLS_KEY", "SF_REDIS_TLS_CA", "SF_REDIS_TLS_CERT",
                      "SF_REDIS_TLS_KEY"):
                assert over[k].startswith("/certs/"), (name, k)
            assert "./certs:/certs:ro" in tls[name]["volumes"], name
            assert set(svc.get("volumes") or []) <= set(tls[name]["volumes"]), name
    assert "--tlsverify" in tls["nats"]["command"]
    redis = tls["redis"]["command"]
    assert redis[redis.index("--port") + 1] == "0" and redis[redis.index("--tls-auth-clients") + 1] == "yes"


def test_interpolation_follows_compose():
    v = {"A": "1", "E": ""}
    assert interpolate("${A}-${B:-x}-${E:-y}-${E-z}", v) == "1-x-y-"
    with pytest.raises(ComposeError, match="B is missing: set B"):
        interpolate("${B:?set B}", v)
    with pytest.raises(ComposeError):
        interpolate("${E:?empty}", v)
