"""The trainer service as a subprocess (`python -m services.trainer`) over real NATS JetStream.

Synthetic `TrajectoryCompleted` groups (token ids from the tiny model's vocabulary,
loss masks, behaviour logprobs, versions) go onto the real TRAJECTORIES stream;
the trainer is the real process with the real DeepSpeed engine. Only the rollout
side is missing: a fake worker heartbeat pins one weight version against GC.

Each test starts its own nats-server (the same launcher as the shared `nats_url`
fixture): the trainer consumes the whole stream, so it must hold only this test's
trajectories, not those the data-plane tests left on the session server.

The record of what was trained is the trainer's own: the ledger inside the final
DeepSpeed checkpoint, cross-checked with the audit log it appends per step.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from seamlessflow.stack import servers
from seamlessflow.stack.processes import DIST_ENV
from services.trainer import audit
from shared import bus, deadletter, subjects, weightstore
from shared.codec import decode, encode
from shared.config import Connections
from shared.messages.rollout import WorkerStatus
from shared.messages.scheduler import TrainerControl, TrainerStatus, TrainGate, TrainGateReply
from shared.messages.trajectory import Sample, TrajectoryCompleted

pytestmark = [pytest.mark.integration, pytest.mark.deepspeed]

ROOT = Path(__file__).resolve().parents[2]
GROUP_SIZE = 4
GROUPS_PER_STEP = 2
READY_TIMEOUT = 90.0


# -- fixtures and helpers ------------------------------------------------------------------------

@pytest.fixture
async def nats(tmp_path):
    """A private nats-server with JetStream, and a client connected to it."""
    port = servers.free_port()
    proc = servers.start_nats(port, tmp_path / "nats")
    url = f"nats://127.0.0.1:{port}"
    nc = await bus.connect(Connections(nats_url=url), name="trainer-test")
    await bus.ensure_streams(nc.jetstream(), subjects.STREAMS)
    yield url, nc
    await nc.close()
    servers.stop(proc)


def make_groups(prefix: str, n_groups: int, vocab: int, version: int, seed: int) -> list[list[TrajectoryCompleted]]:
    """GRPO groups of one-sample trajectories: a prompt (mask 0) then a completion (mask 1)."""
    rng = random.Random(seed)
    groups = []
    for g in range(n_groups):
        members = []
        for i in range(GROUP_SIZE):
            prompt, completion = rng.randint(3, 8), rng.randint(2, 10)
            tokens = [rng.randrange(5, vocab) for _ in range(prompt + completion)]
            sample = Sample(
                token_ids=tokens,
                loss_mask=[0] * prompt + [1] * completion,
                logprobs=[0.0] * prompt + [-6.2 + rng.uniform(-0.2, 0.2) for _ in range(completion)],
                versions=[-1] * prompt + [version - rng.randint(0, 1) if version else 0] * completion,
            )
            members.append(TrajectoryCompleted(session_id=f"{prefix}-s{g}-{i}", group_id=f"{prefix}-g{g}",
                                               reward=float(rng.random() < 0.5), samples=[sample],
                                               policy_version=version))
        groups.append(members)
    return groups


async def publish(nc, trajs: list[TrajectoryCompleted], msg_id: str = "traj-{}") -> None:
    js = nc.jetstream()
    for t in trajs:
        await bus.publish_durable(js, subjects.TRAJ_COMPLETED, t, msg_id=msg_id.format(t.session_id))


def trainer_env(url: str, tmp: Path, durable: str, **extra: str) -> dict[str, str]:
    # Not our SF_* settings, and not the torch.distributed rendezvous of an in-process engine test
    # (its MASTER_PORT is still held by this pytest process).
    env = {k: v for k, v in os.environ.items() if not k.startswith("SF_") and k not in DIST_ENV}
    env.update({
        "SF_NATS_URL": url,
        "SF_TRAINER_DURABLE": durable,
        "SF_TRAINER_GROUP_SIZE": str(GROUP_SIZE),
        "SF_TRAINER_GROUPS_PER_STEP": str(GROUPS_PER_STEP),
        "SF_TRAINER_LR": "1e-3",
        "SF_TRAINER_ACK_WAIT": "2",  # a killed trainer's unacked deliveries come back after 2 s
        "SF_TRAINER_FETCH_TIMEOUT": "0.5",
        "SF_TRAINER_CHECKPOINT_DIR": str(tmp / "ckpt"),
        "SF_TRAINER_WEIGHTS_DIR": str(tmp / "weights"),
        "SF_TRAINER_TENSORBOARD_DIR": str(tmp / "tb"),
        "SF_TRAINER_AUDIT_LOG": str(tmp / "trained.jsonl"),
        "SF_TRAINER_METRICS_PORT": "0",
        "PYTHONUNBUFFERED": "1",
    })
    env.update(extra)
    return env


class Trainer:
    """One trainer process; its stderr goes to a log file the test reads."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path):
        self.log = log
        self._f = open(log, "ab")
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=self._f, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    @classmethod
    def start(cls, model: Path, env: dict[str, str], log: Path, *flags: str) -> "Trainer":
        return cls([sys.executable, "-m", "services.trainer", "--model", str(model), *flags], env, log)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    async def wait_for(self, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while what not in self.text():
            assert self.proc.poll() is None, f"trainer exited {self.proc.returncode}:\n{self.text()[-4000:]}"
            assert time.monotonic() < deadline, f"no {what!r} within {timeout}s:\n{self.text()[-4000:]}"
            await asyncio.sleep(0.1)

    async def wait_exit(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            assert time.monotonic() < deadline, f"trainer still running after {timeout}s:\n{self.text()[-4000:]}"
            await asyncio.sleep(0.1)
        self._f.close()
        return self.proc.returncode

    def kill(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)


async def wait_until(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


def audit_steps(path: Path) -> list[int]:
    return [r["step"] for r in audit.read(path) if r["event"] == "step"] if path.exists() else []


def scrape(port: int) -> dict[str, float]:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {k: float(v) for k, _, v in (line.rpartition(" ") for line in text.splitlines())
            if k and not k.startswith("#")}


def load_params(path: Path) -> dict:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).state_dict()


# -- the crash test ------------------------------------------------------------------------------

@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
async def test_sigkill_and_restart_train_every_trajectory_once(nats, tiny_model, tmp_path, lora):
    """Two runs of the trainer, the first SIGKILLed after a step no checkpoint covers yet.

    Also on the stream: a garbage message (dead-lettered, terminated, training goes on) and two
    re-publishes of sessions under new msg ids (one while the original is still
    buffered, one after a checkpoint covers it): each session trains once.
    """
    import json

    url, nc = nats
    js = nc.jetstream()
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    durable = "trainer-crash" + "-lora" * lora
    metrics_port = servers.free_port()
    # with LoRA: the same fault case, every version an adapter dir and every checkpoint the adapter's
    env = trainer_env(url, tmp_path, durable, SF_TRAINER_CHECKPOINT_EVERY="2", SF_TRAINER_PUBLISH_EVERY="1",
                      SF_TRAINER_KEEP_VERSIONS="2", SF_TRAINER_METRICS_PORT=str(metrics_port),
                      SF_TRAINER_WORKER_STALE_AFTER="2", **({"SF_TRAINER_LORA_RANK": "4"} if lora else {}))
    log_a, log_b = tmp_path / "trainer-a.log", tmp_path / "trainer-b.log"
    audit_path = tmp_path / "trained.jsonl"

    # A rollout worker still serving version 1: GC must keep it.
    async def heartbeat():
        while True:
            st = WorkerStatus("w-old", "serving", 1, 0, 8, "tiny", 2048, time.time())
            await nc.publish(subjects.ROLLOUT_STATUS, encode(st))
            await asyncio.sleep(0.2)

    beats = asyncio.create_task(heartbeat())
    terminated = await nc.subscribe(f"$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.TRAJECTORIES.{durable}")

    # 1. Phase 1: three steps' worth of groups, a duplicate publish of a buffered session, a garbage message.
    phase1 = make_groups("p1", 3 * GROUPS_PER_STEP, vocab, version=0, seed=1)
    await publish(nc, [t for g in phase1 for t in g])
    await publish(nc, [phase1[0][0]], msg_id="retry-{}")  # same session, new msg id: not de-duplicated
    bad = await js.publish(subjects.TRAJ_COMPLETED, b"\x92\x01not a trajectory", headers={"Nats-Msg-Id": "junk"})

    trainer = Trainer.start(tiny_model, env, log_a)
    await trainer.wait_for("trainer ready", READY_TIMEOUT)
    await wait_until(lambda: 3 in audit_steps(audit_path), 60, "step 3 in the audit log")
    await trainer.wait_for("step 3 v3", 10)
    m = scrape(metrics_port)
    assert m["sf_trainer_steps_total"] == 3 and m["sf_trainer_weight_version"] == 3
    assert m['sf_trainer_messages_total{result="bad"}'] == 1
    assert m['sf_bus_malformed_total{service="trainer",subject="sf.traj.completed"}'] == 1
    assert m['sf_trainer_messages_total{result="duplicate"}'] >= 1
    assert "sf_trainer_last_loss" in m and "sf_trainer_last_clip_frac" in m
    assert 'sf_trainer_phase_seconds_count{phase="compute"}' in m
    # Steps 1-2 are checkpointed, step 3 is not: kill it now, mid-run (phase 2 is not even published).
    assert audit.checkpoint_client_state(tmp_path / "ckpt")["step"] == 2
    trainer.kill(signal.SIGKILL)
    assert await trainer.wait_exit(10) == -signal.SIGKILL
    adv = await terminated.next_msg(timeout=5)
    assert json.loads(adv.data)["stream_seq"] == bad.seq  # the garbage was terminated, not left to redeliver
    assert "malformed message on sf.traj.completed" in trainer.text()
    [letter] = await deadletter.recent(js)  # and copied to DEAD before that
    assert (letter.service, letter.subject, letter.size) == ("trainer", subjects.TRAJ_COMPLETED, 18)

    # 2. Restart. The redelivered step-3 trajectories train first; then phase 2 (older policy
    # versions, so staleness shows) and a re-publish of a session that step 1 trained.
    trainer = Trainer.start(tiny_model, env, log_b, "--max-steps", "6")
    await trainer.wait_for("trainer ready", READY_TIMEOUT)
    # heartbeats had worker_stale_after (2 s) to arrive, and w-old's pins version 1: its GC may run now
    await trainer.wait_for("weight versions rollout workers serve: [1]", 30)
    phase2 = make_groups("p2", 3 * GROUPS_PER_STEP, vocab, version=2, seed=2)
    await publish(nc, [t for g in phase2 for t in g])
    await publish(nc, [phase1[1][2]], msg_id="again-{}")
    assert await trainer.wait_exit(90) == 0, trainer.text()[-4000:]
    beats.cancel()
    text = trainer.text()
    assert "resumed from" in text and "at step 2" in text

    # 3. Exactly once, from the final checkpoint's ledger: no duplicates, no gaps.
    published = {t.session_id for g in phase1 + phase2 for t in g}
    ledger = audit.checkpoint_ledger(tmp_path / "ckpt")
    trained = [tid for ids in ledger.values() for tid in ids]
    assert sorted(ledger) == [1, 2, 3, 4, 5, 6]
    assert [tid for tid, n in Counter(trained).items() if n > 1] == []
    assert set(trained) == published
    # The audit log agrees, and shows the lost step 3 trained twice: once lost with the kill, once kept.
    records = audit.read(audit_path)
    assert audit_steps(audit_path).count(3) == 2
    assert audit.trained_steps(records) == ledger
    assert [r["step"] for r in records if r["event"] == "resume"] == [0, 2]
    # Nothing is left unacked or pending on the consumer.
    info = await js.consumer_info("TRAJECTORIES", durable)
    assert (info.num_pending, info.num_ack_pending) == (0, 0)

    # 4. Weights: versions only go up, across the restart too; the store keeps the newest 2 plus
    # the version a worker still serves; snapshots load with transformers and moved from the start.
    versions = [r["version"] for r in records if r["event"] == "step"]
    assert versions == sorted(set(versions)) and versions[0] == 1
    last = await weightstore.current(js)
    assert last.version == versions[-1] == 7 and last.step == 6
    assert weightstore.versions_on_disk(tmp_path / "weights") == [1, 6, 7]
    assert Path(last.path) == weightstore.version_dir(tmp_path / "weights", 7).resolve()
    final_dir = Path(last.path)
    if lora:
        from shared import adapters

        assert adapters.is_adapter(final_dir)
        final_dir = adapters.merge_into_base(tiny_model, final_dir, tmp_path / "merged")
    initial, final = load_params(tiny_model), load_params(final_dir)
    assert initial.keys() == final.keys()
    assert any(not (initial[k] == final[k]).all() for k in initial)
    weightstore.check_checkpoint(weightstore.version_dir(tmp_path / "weights", 1))
    # TensorBoard events were written.
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert events and any(b"train/loss" in e.read_bytes() for e in events)


# -- a graceful stop -----------------------------------------------------------------------------

async def test_sigterm_drains_checkpoints_and_hands_back_the_rest(nats, tiny_model, tmp_path):
    """SIGTERM: the trained steps get a checkpoint and their acks; an incomplete group is nak'd, not lost."""
    import json

    url, nc = nats
    js = nc.jetstream()
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    durable = "trainer-drain"
    env = trainer_env(url, tmp_path, durable, SF_TRAINER_CHECKPOINT_EVERY="100", SF_TRAINER_PUBLISH_EVERY="2",
                      SF_TRAINER_ACK_WAIT="60")
    groups = make_groups("d", GROUPS_PER_STEP + 1, vocab, version=0, seed=3)
    await publish(nc, [t for g in groups for t in g][:-1])  # the last group lacks one member
    trainer = Trainer.start(tiny_model, env, tmp_path / "trainer.log")
    await trainer.wait_for("trainer ready", READY_TIMEOUT)
    await trainer.wait_for("step 1 v0", 30)  # publish_every=2: step 1 publishes nothing
    trainer.kill(signal.SIGTERM)
    assert await trainer.wait_exit(30) == 0, trainer.text()[-4000:]
    assert "3 untrained deliveries handed back" in trainer.text()
    ledger = audit.checkpoint_ledger(tmp_path / "ckpt")
    assert ledger == {1: sorted(t.session_id for g in groups[:GROUPS_PER_STEP] for t in g)}
    assert await weightstore.current(js) is None
    # The incomplete group was nak'd: the next consumer gets it now, not after ack_wait (60 s).
    sub = await js.pull_subscribe(subjects.TRAJ_COMPLETED, durable=durable)
    msgs = await sub.fetch(10, timeout=3)
    assert sorted(decode(m.data, TrajectoryCompleted).session_id for m in msgs) == \
        sorted(t.session_id for t in groups[-1][:-1])
    assert all(m.metadata.num_delivered == 2 for m in msgs)


# -- two ranks -----------------------------------------------------------------------------------

async def test_two_ranks_under_torchrun(nats, tiny_model, tmp_path):
    """torchrun, 2 gloo ranks, ZeRO 2: rank 0 consumes and broadcasts; both train their shards."""
    import json

    url, nc = nats
    js = nc.jetstream()
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    env = trainer_env(url, tmp_path, "trainer-dp", SF_TRAINER_ZERO_STAGE="2", SF_TRAINER_CHECKPOINT_EVERY="1")
    groups = make_groups("dp", 2 * GROUPS_PER_STEP, vocab, version=0, seed=4)
    await publish(nc, [t for g in groups for t in g])
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "-m", "services.trainer", "--model", str(tiny_model), "--max-steps", "2"]
    trainer = Trainer(argv, env, tmp_path / "trainer.log")
    assert await trainer.wait_exit(150) == 0, trainer.text()[-4000:]
    text = trainer.text()
    assert "2 rank(s)" in text and "step 2 v2" in text
    ledger = audit.checkpoint_ledger(tmp_path / "ckpt")
    assert sorted(t for ids in ledger.values() for t in ids) == sorted(t.session_id for g in groups for t in g)
    last = await weightstore.current(js)
    assert last.version == 2
    final_dir = Path(last.path)
    initial, final = load_params(tiny_model), load_params(final_dir)
    assert any(not (initial[k] == final[k]).all() for k in initial)
    info = await js.consumer_info("TRAJECTORIES", "trainer-dp")
    assert (info.num_pending, info.num_ack_pending) == (0, 0)


# -- the scheduler's handles -----------------------------------------------------------------------

async def test_status_heartbeats_gate_and_offload_against_a_fake_scheduler(nats, tiny_model, tmp_path):
    """TrainerStatus heartbeats carry the states; with the gate on, step 1 starts only after a fake
    scheduler grants it; with no scheduler answering, step 2 logs why and runs anyway;
    offload/reload requests are answered with a status."""
    import json

    url, nc = nats
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    env = trainer_env(url, tmp_path, "trainer-gate", SF_TRAINER_SCHEDULER_GATE="true", SF_TRAINER_GATE_TIMEOUT="3",
                      SF_TRAINER_HOST="host-0")
    statuses: list[tuple[TrainerStatus, float]] = []  # (status, monotonic receive time)
    gates: list[TrainGate] = []
    granted_at: list[float] = []

    async def on_status(msg):
        statuses.append((decode(msg.data, TrainerStatus), time.monotonic()))

    async def scheduler(msg):
        gates.append(decode(msg.data, TrainGate))
        await asyncio.sleep(1.0)  # reclaiming the trainer's hosts
        granted_at.append(time.monotonic())
        await msg.respond(encode(TrainGateReply(granted=True, waited_s=1.0)))

    def seen(state: str, step: int) -> list[float]:
        return [t for s, t in statuses if s.state == state and s.step == step]

    await nc.subscribe(subjects.TRAINER_STATUS, cb=on_status)
    gate_sub = await nc.subscribe(subjects.SCHED_GATE, cb=scheduler)
    trainer = Trainer.start(tiny_model, env, tmp_path / "trainer.log", "--max-steps", "2")
    await trainer.wait_for("trainer ready", READY_TIMEOUT)

    # 1. idle: a heartbeat about every second, "waiting", naming the host
    await wait_until(lambda: len(seen("waiting", 0)) >= 3, 5, "three waiting heartbeats")
    beats = seen("waiting", 0)
    assert 0.5 < beats[2] - beats[1] < 2.0
    assert statuses[-1][0].hosts == ["host-0"] and statuses[-1][0].group_size == GROUP_SIZE

    # 2. offload and reload (timed no-ops on CPU), each answered with a status
    for op in ("offload", "reload"):
        reply = await nc.request(subjects.TRAINER_CTL, encode(TrainerControl(op=op, host="host-0")), timeout=30)
        assert decode(reply.data, TrainerStatus).state == "waiting"
        await trainer.wait_for(f"{op} for host host-0", 5)

    # 3. a batch: ready, the gate, then computing only once the scheduler granted it
    groups = make_groups("gate", 2 * GROUPS_PER_STEP, vocab, version=0, seed=5)
    await publish(nc, [t for g in groups[:GROUPS_PER_STEP] for t in g])
    await trainer.wait_for("step 1 v1", 60)
    assert gates == [TrainGate(step=1, timeout=3.0, hosts=["host-0"])]
    await wait_until(lambda: seen("publishing", 1), 5, "step 1 publishing")
    assert seen("ready", 0)[0] < granted_at[0] <= seen("computing", 0)[0]
    assert "step 1: gate granted" in trainer.text()

    # 4. no scheduler: the step says why and computes anyway
    await gate_sub.unsubscribe()
    await publish(nc, [t for g in groups[GROUPS_PER_STEP:] for t in g])
    assert await trainer.wait_exit(90) == 0, trainer.text()[-4000:]
    assert "step 2: gate not granted (no scheduler answers on sf.sched.gate)" in trainer.text()
    assert "step 2 v2" in trainer.text() and len(gates) == 1
    await wait_until(lambda: seen("stopped", 2), 5, "the stopped status")
