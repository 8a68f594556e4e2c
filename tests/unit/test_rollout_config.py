"""services/rollout/config.py: env-driven settings, CLI overrides, worker ids that are subject tokens."""

from __future__ import annotations

import pytest

from services.rollout.config import RolloutConfig, initial_version, load_config, served_name
from shared.config import ConfigError, load


def test_defaults_and_env(monkeypatch):
    monkeypatch.setenv("SF_ROLLOUT_MODEL", "/m/qwen/")
    monkeypatch.setenv("SF_ROLLOUT_MAX_NUM_SEQS", "4")
    monkeypatch.setenv("SF_ROLLOUT_ENFORCE_EAGER", "false")
    cfg = load_config(worker_id="w-1")
    assert (cfg.model, cfg.worker_id, cfg.max_num_seqs, cfg.enforce_eager) == ("/m/qwen/", "w-1", 4, False)
    assert (cfg.max_model_len, cfg.dtype, cfg.kv_cache_gib, cfg.max_request_seconds) == (2048, "float32", 1, 600)
    assert served_name(cfg) == "qwen"


def test_worker_id_defaults_to_host_pid(monkeypatch):
    monkeypatch.delenv("SF_ROLLOUT_WORKER_ID", raising=False)
    cfg = load_config(model="m")
    assert cfg.worker_id.endswith(f"-{__import__('os').getpid()}") and "." not in cfg.worker_id


@pytest.mark.parametrize("wid", ["a.b", "a b", "w*", "w>"])
def test_worker_id_must_be_one_subject_token(wid):
    with pytest.raises(ConfigError):
        load_config(model="m", worker_id=wid)


def test_model_is_required_and_typos_fail():
    with pytest.raises(ConfigError):
        load(RolloutConfig, "SF_ROLLOUT_", env={})
    with pytest.raises(ConfigError, match="unknown setting"):
        load(RolloutConfig, "SF_ROLLOUT_", env={"SF_ROLLOUT_MODEL": "m", "SF_ROLLOUT_MAX_SEQS": "3"})


def test_update_policy_is_a_closed_set():
    env = {"SF_ROLLOUT_MODEL": "m", "SF_ROLLOUT_UPDATE_POLICY": "drain"}
    assert load(RolloutConfig, "SF_ROLLOUT_", env=env).update_policy == "drain"
    with pytest.raises(ConfigError, match="update_policy"):
        load(RolloutConfig, "SF_ROLLOUT_", env={**env, "SF_ROLLOUT_UPDATE_POLICY": "later"})


def test_start_vacated_and_the_initial_version(monkeypatch):
    cfg = load_config(model="m", worker_id="w")
    assert not cfg.start_vacated and initial_version(cfg) == 0  # no scheduler: serve version 0 at once
    monkeypatch.setenv("SF_ROLLOUT_START_VACATED", "true")
    cfg = load_config(model="/store/v000012/", worker_id="w")
    assert cfg.start_vacated and initial_version(cfg) == 12  # a weight-store dir names its version
    assert initial_version(load_config(model="/store/v000012", worker_id="w", initial_version=4)) == 4
    assert initial_version(load_config(model="/store/v12", worker_id="w")) == 0  # not the store's naming


def test_split_cpus_gives_each_local_engine_its_own_cores():
    from seamlessflow.stack import split_cpus

    assert split_cpus([0, 1], 2) == ["0", "1"]
    assert split_cpus([3, 2, 1, 0], 2) == ["0,1", "2,3"]
    assert split_cpus([0, 1, 2, 3, 4], 2) == ["0,1", "2,3"]
    assert split_cpus([0], 3) == ["0", "0", "0"]
    assert split_cpus([0, 1], 3) == ["0", "1", "0"]
    assert split_cpus([0, 1], 0) == [] and split_cpus([], 2) == []
