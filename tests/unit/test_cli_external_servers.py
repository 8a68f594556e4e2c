"""`up --nats-url URLS --redis-url URL` runs against servers that exist (none of its own), and
`--train` works without `--policy` (issue 30)."""

from __future__ import annotations

import argparse

from seamlessflow import cli
from seamlessflow.stack import Stack


def options(tmp_path, *argv):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    p = argparse.ArgumentParser()
    cli._up_args(p)
    return cli._stack_options(p.parse_args(["--model", str(model), "--data-dir", str(tmp_path / "var"), *argv]))


def test_external_servers_are_used_and_none_started(tmp_path, monkeypatch):
    seeds = "nats://a:4222,nats://b:4222,nats://c:4222"
    o = options(tmp_path, "--nats-url", seeds, "--redis-url", "redis+sentinel://s1:26379,s2:26379/sf/0", "--train")
    assert (o.external_nats, o.external_redis, o.train, o.policy) == (
        seeds, "redis+sentinel://s1:26379,s2:26379/sf/0", True, "")
    stack = Stack(o)
    assert stack.nats_url == seeds and stack.redis_url.startswith("redis+sentinel://")
    spawned = []
    monkeypatch.setattr(Stack, "_spawn", lambda self, name, *a, **k: spawned.append(name))
    stack._spawn_infra()
    assert spawned == []  # no nats-server, no redis-server of its own


def test_train_without_a_policy_spawns_the_trainer(tmp_path, monkeypatch):
    stack = Stack(options(tmp_path, "--train", "--nats-url", "nats://x:4222", "--redis-url", "redis://x:6379/0"))
    spawned = []
    for name in ("spawn_trajectory", "spawn_rollout", "spawn_trainer", "_spawn_gateway"):
        monkeypatch.setattr(Stack, name, lambda self, *a, _n=name, **k: spawned.append(_n))
    monkeypatch.setattr(Stack, "running_elsewhere", lambda self: None)
    stack.start(wait=False)
    assert spawned == ["spawn_trajectory", "spawn_rollout", "spawn_trainer", "_spawn_gateway"]
