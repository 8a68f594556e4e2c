"""A demo is a run of its own: it clears what an earlier run left in the data dir (streams, Redis,
trainer checkpoints, weight versions, report) and keeps the models, credentials and logs."""

from seamlessflow.demo.run import RUN_STATE, clear_run_state


def test_an_earlier_runs_state_is_cleared_and_the_models_kept(tmp_path):
    for d in ("nats/jetstream", "redis", "trainer/checkpoints", "weights/v3", "report", "model-small",
              "model-small-reverse-sft-s0", "logs"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "trainer/checkpoints/step-60.pt").write_text("x")
    (tmp_path / "trajectories.jsonl").write_text("{}\n")
    (tmp_path / "credentials.json").write_text("{}")
    (tmp_path / "model-small-reverse-sft-s0/config.json").write_text("{}")

    gone = clear_run_state(tmp_path)

    assert sorted(gone) == sorted(RUN_STATE)
    assert not any((tmp_path / name).exists() for name in RUN_STATE)
    assert (tmp_path / "model-small-reverse-sft-s0/config.json").exists()
    assert (tmp_path / "credentials.json").exists() and (tmp_path / "logs").is_dir()


def test_a_fresh_data_dir_has_nothing_to_clear(tmp_path):
    assert clear_run_state(tmp_path) == []
    assert clear_run_state(tmp_path / "not-made-yet") == []
