"""services/trainer/ledger.py: exactly-once decisions across redeliveries and crashes, plus trainer config."""

from __future__ import annotations

import json
import random

import pytest

from services.trainer.ledger import Ledger, Verdict


def test_lifecycle_new_in_flight_done():
    led = Ledger()
    assert led.admit("a") is Verdict.NEW
    assert led.admit("a") is Verdict.IN_FLIGHT  # ack_wait expired while buffered
    led.trained(["a"], step=1)
    assert led.admit("a") is Verdict.IN_FLIGHT  # trained but no checkpoint yet: not ackable
    assert led.commit(1) == ["a"]
    assert led.admit("a") is Verdict.DONE
    assert led.counts() == {"done": 1, "pending": 0, "in_flight": 0, "skipped": 1}


def test_training_unadmitted_or_twice_is_an_error():
    led = Ledger()
    with pytest.raises(ValueError, match="not admitted"):
        led.trained(["x"], step=1)
    led.admit("x")
    led.trained(["x"], step=1)
    with pytest.raises(ValueError, match="not admitted"):
        led.trained(["x"], step=2)
    led.commit(1)
    with pytest.raises(ValueError, match="not after the committed step"):
        led.trained([], step=1)


def test_snapshot_covers_only_steps_up_to_the_checkpoint():
    led = Ledger()
    for tid, step in [("a", 1), ("b", 2), ("c", 3)]:
        led.admit(tid)
        led.trained([tid], step)
    snap = led.snapshot(2)
    assert snap == {"committed_step": 2, "trained": {"1": ["a"], "2": ["b"]}}
    assert json.loads(json.dumps(snap)) == snap
    assert sorted(led.commit(2)) == ["a", "b"]
    assert not led.is_done("c")


def test_release_lets_a_redelivery_train():
    led = Ledger()
    led.admit("g1")
    led.release(["g1"])
    assert led.admit("g1") is Verdict.NEW


def test_prune_forgets_old_done_ids():
    led = Ledger()
    for step in range(1, 5):
        led.admit(f"t{step}")
        led.trained([f"t{step}"], step)
    led.commit(4)
    assert led.prune(before_step=3) == 2
    assert not led.is_done("t1") and led.is_done("t3")


def test_crash_and_redelivery_trains_every_id_exactly_once():
    """Simulated JetStream + crashes: the surviving lineage trains each id once, and none is lost."""
    rng = random.Random(3)
    ids = [f"traj-{i}" for i in range(200)]
    unacked = list(ids)  # the stream: everything not acked gets (re)delivered
    checkpoint = None  # (state, lineage) as of the last durable checkpoint
    led, lineage, step = Ledger(), [], 0
    acked: set[str] = set()
    restarts = attempts = 0
    while unacked:
        batch = []
        for tid in rng.sample(unacked, min(len(unacked), rng.randint(1, 12))):
            v = led.admit(tid)
            if v is Verdict.DONE:
                unacked.remove(tid)
                acked.add(tid)
            elif v is Verdict.NEW:
                batch.append(tid)
        if not batch:
            continue
        step += 1
        attempts += len(batch)
        led.trained(batch, step)
        lineage.append((step, batch))
        if rng.random() < 0.5:  # checkpoint, then ack what it covers
            checkpoint = (led.snapshot(step), list(lineage))
            if rng.random() < 0.2:
                pass  # crash between the durable save and the acks: ids stay unacked
            else:
                for tid in led.commit(step):
                    unacked.remove(tid)
                    acked.add(tid)
        if rng.random() < 0.15:  # SIGKILL: restart from the last checkpoint
            state, saved = checkpoint if checkpoint else (None, [])
            led, lineage = Ledger.restore(state), list(saved)
            restarts += 1
            step = led.committed_step if checkpoint else 0
    trained = [tid for _, batch in lineage for tid in batch]
    assert restarts >= 3 and attempts > len(ids)  # crashes happened and lost work was redone
    assert len(trained) == len(set(trained))  # no duplicates
    assert set(trained) == set(ids)  # no gaps
    assert acked == set(ids)


def test_trainer_config_reads_env_and_validates():
    from services.trainer.config import TrainerConfig
    from shared.config import ConfigError, load

    cfg = load(TrainerConfig, prefix="SF_TRAINER_",
               env={"SF_TRAINER_ZERO_STAGE": "2", "SF_TRAINER_ADVANTAGE": "rloo", "SF_TRAINER_TIS": "false"})
    assert (cfg.zero_stage, cfg.algo().advantage, cfg.algo().tis) == (2, "rloo", False)
    with pytest.raises(ConfigError):
        load(TrainerConfig, prefix="SF_TRAINER_", env={"SF_TRAINER_ZERO": "2"})
    with pytest.raises(ValueError):
        TrainerConfig(advantage="nope")
