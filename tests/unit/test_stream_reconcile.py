"""shared/bus.reconcile and shared/config's seed list and replica count: start-up never lowers an
existing stream's replicas or limits, raises what the configuration raises, and names the fix."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shared import subjects
from shared.bus import reconcile
from shared.config import ConfigError, Connections, jetstream_replicas

TRAJ = next(s for s in subjects.streams(replicas=1) if s.name == subjects.TRAJECTORIES_STREAM)


def test_seed_list_and_replicas():
    conn = Connections(nats_url="nats://a:4222, nats://u:p@b:4222,")
    assert conn.nats_servers == ["nats://a:4222", "nats://u:p@b:4222"]
    assert "p@" not in conn.redacted()["nats_url"]
    assert jetstream_replicas({}) == 1 and jetstream_replicas({"SF_JETSTREAM_REPLICAS": "3"}) == 3
    with pytest.raises(ConfigError):
        jetstream_replicas({"SF_JETSTREAM_REPLICAS": "0"})
    assert {s.num_replicas for s in subjects.streams(replicas=3)} == {3}


def test_same_config_needs_no_update():
    assert reconcile(TRAJ, TRAJ) == (None, [])


def test_never_lowers_replicas_or_limits_and_says_how():
    existing = replace(TRAJ, num_replicas=3, max_bytes=10 << 30, max_msgs=-1)
    update, left = reconcile(existing, replace(TRAJ, num_replicas=1, max_bytes=1 << 20, max_msgs=100))
    assert update is None
    assert left == ["--replicas 1", f"--max-bytes {1 << 20}", "--max-msgs 100"]


def test_raises_a_limit_but_keeps_replicas():
    existing = replace(TRAJ, num_replicas=1, max_bytes=1 << 20)
    update, left = reconcile(existing, replace(TRAJ, num_replicas=3, max_bytes=2 << 20))
    assert update is not None and (update.num_replicas, update.max_bytes) == (1, 2 << 20)
    assert left == ["--replicas 3"]
