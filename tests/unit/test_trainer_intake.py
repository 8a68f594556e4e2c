"""services/trainer/{intake,audit,metrics,config}.py: the service's pure parts, with fake deliveries.

The deliveries are plain strings: the intake treats messages as opaque handles, so
what it returns to ack, hold, nak or terminate is checked by identity.
"""

from __future__ import annotations

import math

import pytest

from services.trainer import audit
from services.trainer.intake import Action, Intake, check_trajectory
from services.trainer.ledger import Ledger
from services.trainer.metrics import Metrics, format_line, lag_label, staleness_summary
from shared.messages.trajectory import Sample, TrajectoryCompleted


def traj(sid: str, gid: str, reward: float = 1.0, tokens=(1, 2, 3), mask=(0, 1, 1)) -> TrajectoryCompleted:
    n = len(tokens)
    s = Sample(list(tokens), list(mask), [0.0 if not m else -1.0 for m in mask], [-1 if not m else 0 for m in mask])
    assert len(mask) == n
    return TrajectoryCompleted(session_id=sid, group_id=gid, reward=reward, samples=[s])


def test_groups_complete_and_batches_are_taken_whole():
    it = Intake(group_size=2)
    assert it.offer(traj("a1", "A"), "m-a1", 0.0) is Action.TRAIN
    assert it.offer(traj("b1", "B"), "m-b1", 0.0) is Action.TRAIN
    assert it.take(1) is None  # no complete group yet
    it.offer(traj("a2", "A"), "m-a2", 0.0)
    assert it.ready_groups() == 1 and it.take(2) is None
    [[x, y]] = it.take(1)
    assert {x.session_id, y.session_id} == {"a1", "a2"}
    assert it.counts()["open_groups"] == 1 and it.counts()["held_msgs"] == 3


def test_acks_wait_for_the_checkpoint_and_cover_every_delivery():
    it = Intake(group_size=2)
    it.offer(traj("a1", "A"), "m1", 0.0)
    assert it.offer(traj("a1", "A"), "m1-redelivered", 0.0) is Action.HOLD  # ack_wait ran out once
    it.offer(traj("a2", "A"), "m2", 0.0)
    ids = [t.session_id for g in it.take(1) for t in g]
    it.trained(ids, step=1)
    assert it.offer(traj("a2", "A"), "m2-republished", 0.0) is Action.HOLD  # trained, not yet checkpointed
    assert sorted(it.held()) == ["m1", "m1-redelivered", "m2", "m2-republished"]
    snap = it.snapshot(1)
    assert sorted(it.committed(1)) == ["m1", "m1-redelivered", "m2", "m2-republished"]
    assert it.held() == []
    assert it.offer(traj("a1", "A"), "m1-late", 0.0) is Action.ACK  # covered: ack, never train
    assert it.duplicates == 3

    # After a restart from that checkpoint the same answer holds.
    again = Intake(group_size=2, ledger=Ledger.restore(snap))
    assert again.offer(traj("a2", "A"), "m2-after-restart", 0.0) is Action.ACK


def test_a_crash_before_the_checkpoint_trains_the_step_again():
    it = Intake(group_size=1)
    it.offer(traj("a", "A"), "m", 0.0)
    it.trained(["a"], step=1)
    before = it.snapshot(0)  # the last durable checkpoint predates step 1
    restarted = Intake(group_size=1, ledger=Ledger.restore(before))
    assert restarted.offer(traj("a", "A"), "m-redelivered", 0.0) is Action.TRAIN


def test_incomplete_groups_expire_and_shutdown_hands_back_only_untrained():
    it = Intake(group_size=2)
    it.offer(traj("a1", "A"), "ma1", 100.0)
    it.offer(traj("b1", "B"), "mb1", 150.0)
    it.offer(traj("c1", "C"), "mc1", 150.0)
    it.offer(traj("c2", "C"), "mc2", 150.0)
    it.trained([t.session_id for g in it.take(1) for t in g], step=1)  # C trained, not checkpointed
    assert it.expire(now=200.0, timeout=0) == ([], [])  # 0 = never
    assert it.expire(now=200.0, timeout=60.0) == (["A"], ["ma1"])
    assert it.offer(traj("a1", "A"), "ma1-again", 210.0) is Action.TRAIN  # released, so new again
    assert sorted(it.untrained()) == ["ma1-again", "mb1"]  # C waits for its checkpoint, not a nak


@pytest.mark.parametrize("bad, why", [
    (traj("s", "g", tokens=(1, 2, 999)), "vocabulary"),
    (traj("s", "g", tokens=(1, -2, 3)), "vocabulary"),
    (traj("s", "g", mask=(1, 1, 1)), "loss_mask"),
    (traj("s", "g", reward=math.nan), "finite"),
    (TrajectoryCompleted(session_id="s", group_id="g", reward=0.0, samples=[]), "no samples"),
    (TrajectoryCompleted(session_id="", group_id="g", reward=0.0, samples=traj("s", "g").samples), "empty"),
    (TrajectoryCompleted(session_id="s", group_id="g", reward=0.0,
                         samples=[Sample([1, 2], [0, 1], [0.0], [-1, 0])]), "differ in length"),
])
def test_check_trajectory_refuses_what_a_step_cannot_train(bad, why):
    with pytest.raises(ValueError, match=why):
        check_trajectory(bad, vocab_size=512)
    check_trajectory(traj("s", "g", tokens=(0, 511, 7)), vocab_size=512)


def test_audit_log_drops_steps_a_crash_lost(tmp_path):
    log = audit.AuditLog(tmp_path / "a" / "trained.jsonl")
    log.resume(0)
    log.step(1, 1, ["a", "b"])
    log.step(2, 2, ["c"])
    log.checkpoint(2, "step-00000002")
    log.step(3, 3, ["d"])  # lost with the crash
    log.resume(2)
    log.step(3, 4, ["d", "e"])
    with open(tmp_path / "a" / "trained.jsonl", "a") as f:
        f.write('{"event": "step", "st')  # a torn last line
    records = audit.read(tmp_path / "a" / "trained.jsonl")
    assert audit.trained_steps(records) == {1: ["a", "b"], 2: ["c"], 3: ["d", "e"]}
    assert audit.AuditLog(None).path is None  # off: writes nothing
    audit.AuditLog(None).step(1, 1, ["x"])


def test_metrics_line_counters_and_tensorboard(tmp_path):
    assert [lag_label(k) for k in (-1, 0, 7, 8, 30)] == ["neg", "0", "7", "8+", "8+"]
    assert staleness_summary({0: 3, 2: 1}) == {"staleness_mean": 0.5, "staleness_max": 2.0}
    assert staleness_summary({}) == {"staleness_mean": 0.0, "staleness_max": 0.0}
    m = Metrics(port=0, tensorboard_dir=str(tmp_path / "tb"))
    step_metrics = {"loss": 0.25, "reward_mean": 0.5, "reward_std": 0.1, "adv_mean": 0.0, "adv_std": 1.0,
                    "clip_frac": 0.01, "is_weight_mean": 1.0, "is_weight_max": 1.5, "trajectories": 8.0,
                    "tokens": 40.0, "compute_s": 0.2, "wait_s": 1.0, "publish_s": 0.1, "checkpoint_s": 0.3,
                    "train_tokens_per_s": 200.0}
    line = m.step(3, 4, step_metrics, {0: 30, 1: 10})
    assert line.startswith("step 3 v4 loss=0.25 reward=0.500±0.100")
    assert "stale=0:30,1:10" in line and "wait=1.00s compute=0.20s publish=0.10s ckpt=0.30s" in line
    value = m.registry.get_sample_value
    assert value("sf_trainer_steps_total") == 1 and value("sf_trainer_tokens_total") == 40
    assert value("sf_trainer_token_staleness_total", {"lag": "1"}) == 10
    assert value("sf_trainer_last_loss") == 0.25 and value("sf_trainer_weight_version") == 4
    assert value("sf_trainer_last_staleness_mean") == 0.25
    assert value("sf_trainer_phase_seconds_count", {"phase": "wait"}) == 1
    m.count("bad")
    assert value("sf_trainer_messages_total", {"result": "bad"}) == 1
    m.close()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert "loss=nan" in format_line(1, 0, {}, {})  # a missing metric shows, it does not crash


def test_trainer_service_config(monkeypatch):
    from services.trainer.config import TrainerConfig, load_config
    from shared.config import ConfigError

    cfg = load_config(env={"SF_WEIGHTS_DIR": "/store"})
    assert (cfg.weights_dir, cfg.durable, cfg.checkpoint_every, cfg.publish_every) == ("/store", "trainer", 1, 1)
    assert load_config(env={"SF_TRAINER_WEIGHTS_DIR": "/mine", "SF_WEIGHTS_DIR": "/store"}).weights_dir == "/mine"
    assert load_config(env={}, max_steps=5, model_dir=None).max_steps == 5
    with pytest.raises(ConfigError, match="max_ack_pending"):
        load_config(env={"SF_TRAINER_MAX_ACK_PENDING": "10", "SF_TRAINER_GROUP_SIZE": "8"})
    with pytest.raises(ConfigError):
        load_config(env={"SF_TRAINER_CHECKPOINT_EVERY": "0"})
    with pytest.raises(ValueError):
        TrainerConfig(publish_every=0)


def test_check_trajectory_with_roles_wants_a_known_role():
    import msgspec

    t = traj("s", "g")
    check_trajectory(t, vocab_size=512)  # no roles configured: any session trains the one adapter
    with pytest.raises(ValueError, match="has no adapter"):
        check_trajectory(t, vocab_size=512, roles=("planner", "solver"))
    with pytest.raises(ValueError, match="'critic' has no adapter"):
        check_trajectory(msgspec.structs.replace(t, metadata={"role": "critic"}), 512, ("planner", "solver"))
    check_trajectory(msgspec.structs.replace(t, metadata={"role": "solver"}), 512, ("planner", "solver"))
