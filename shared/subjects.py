"""Subject names and JetStream stream specs: the map of who talks to whom.

Core NATS (request/reply, low latency, no persistence):
    sf.chat                      gateway -> trajectory (queue group "trajectory"); streamed replies
    sf.session.<op>              gateway -> trajectory (queue group "trajectory"); create/get/reward/finish
    sf.rollout.gen.<worker_id>   trajectory -> one rollout worker; streamed replies
    sf.rollout.ctl.<worker_id>   admin -> one rollout worker (pause/resume/vacate)
    sf.rollout.status            rollout workers -> everyone: load and weight version heartbeats
    sf.sched.host                host agents -> scheduler: HostHeartbeat
    sf.sched.changed             host agents -> scheduler: HostModeChanged (an assignment applied)
    sf.sched.ctl                 operators -> scheduler: SchedulerControl -> SchedulerReply
    sf.sched.gate                trainer -> scheduler: TrainGate -> TrainGateReply (reclaim my hosts)
    sf.sched.leader              the leading scheduler -> host agents: SchedulerLeader (its term, every second)
    sf.trainer.status            trainer rank 0 -> everyone: TrainerStatus heartbeats
    sf.trainer.ctl               host agents -> trainer rank 0: TrainerControl (offload/reload)

JetStream (durable, explicit ack):
    sf.traj.completed            TRAJECTORIES stream: one TrajectoryCompleted per finished session
    sf.weights.published         WEIGHTS stream, last value per subject: WeightsPublished
    sf.weights.fetch             request/reply (core NATS): WeightsWanted -> WeightsPublished
    sf.sched.assign.<host>       HOSTS stream, last value per subject: HostAssignment
    sf.dead.<service>.<subject>  DEAD stream: copies of stored messages a service could not read
                                 (shared/deadletter.py; `seamlessflow dead list`)
"""

from __future__ import annotations

from dataclasses import replace

from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from shared.backpressure import TrajectoryLimits, limits_from_env
from shared.config import jetstream_replicas
from shared.deadletter import DEAD_STREAM, dead_stream  # noqa: F401 (DEAD_STREAM: the name, with the others)

CHAT = "sf.chat"
SESSION = "sf.session"  # + ".create" | ".get" | ".reward" | ".finish"
TRAJECTORY_QUEUE = "trajectory"


def session_op(op: str) -> str:
    return f"{SESSION}.{op}"


def rollout_gen(worker_id: str) -> str:
    return f"sf.rollout.gen.{worker_id}"


def rollout_ctl(worker_id: str) -> str:
    return f"sf.rollout.ctl.{worker_id}"


ROLLOUT_STATUS = "sf.rollout.status"

TRAJ_COMPLETED = "sf.traj.completed"
WEIGHTS_PUBLISHED = "sf.weights.published"
WEIGHTS_FETCH = "sf.weights.fetch"  # request/reply: WeightsWanted -> WeightsPublished (a catch-up round)

TRAJECTORIES_STREAM = "TRAJECTORIES"  # sf.traj.completed
# seconds within which a stream drops a second message with the same Nats-Msg-Id: a publisher's
# retries (bus.publish_durable's retry_for) stay inside it, so a retried publish lands once
DUPLICATE_WINDOW_S = 120.0
WEIGHTS_STREAM = "WEIGHTS"  # sf.weights.published, last value per subject
HOSTS_STREAM = "HOSTS"  # sf.sched.assign.<host>, last value per subject
# The trainer's durable consumer on TRAJECTORIES; admission control reads its backlog, and
# from its metadata how many sessions the trainer trains per published version.
TRAINER_DURABLE = "trainer"
SESSIONS_PER_VERSION = "sessions_per_version"  # trainer consumer metadata key (an int, as text)


def trainer_consumer(durable: str, sessions_per_version: int, ack_wait: float = 60.0, max_deliver: int = 10,
                     max_ack_pending: int = 10000) -> ConsumerConfig:
    """The trainer's durable pull consumer on TRAJECTORIES: explicit ack, bounded redeliveries."""
    return ConsumerConfig(
        durable_name=durable, filter_subject=TRAJ_COMPLETED, ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL, ack_wait=ack_wait, max_deliver=max_deliver,
        max_ack_pending=max_ack_pending, metadata={SESSIONS_PER_VERSION: str(sessions_per_version)})


def sessions_per_version(consumer: ConsumerConfig) -> int | None:
    """What `trainer_consumer` declared; None for a consumer that does not say."""
    raw = (consumer.metadata or {}).get(SESSIONS_PER_VERSION, "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else None

SCHED_HOST = "sf.sched.host"
SCHED_CHANGED = "sf.sched.changed"
SCHED_CTL = "sf.sched.ctl"
SCHED_GATE = "sf.sched.gate"
SCHED_LEADER = "sf.sched.leader"  # the leading scheduler -> host agents: SchedulerLeader (its term)
TRAINER_STATUS = "sf.trainer.status"
TRAINER_CTL = "sf.trainer.ctl"
SCHED_ASSIGN_PREFIX = "sf.sched.assign"


def sched_assign(host: str) -> str:
    return f"{SCHED_ASSIGN_PREFIX}.{host}"


def streams(limits: TrajectoryLimits | None = None, replicas: int | None = None) -> tuple[StreamConfig, ...]:
    """Every stream, with TRAJECTORIES' limits from `limits` (default: SF_TRAJECTORIES_* now) and each
    kept on `replicas` servers (default: SF_JETSTREAM_REPLICAS now, 1 unless set)."""
    limits = limits or limits_from_env()
    replicas = replicas or jetstream_replicas()
    return tuple(replace(s, num_replicas=replicas) for s in (
        StreamConfig(
            name=TRAJECTORIES_STREAM,
            subjects=[TRAJ_COMPLETED],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            duplicate_window=DUPLICATE_WINDOW_S,
            max_bytes=limits.max_bytes,
            max_msgs=limits.max_msgs,
            # a full stream refuses the publish and the trajectory manager retries and pushes back;
            # never DiscardPolicy.OLD, which deletes the oldest trajectories, trained or not
            # (shared/backpressure.py trims only trained ones)
            discard=DiscardPolicy.NEW,
        ),
        StreamConfig(
            name=WEIGHTS_STREAM,
            subjects=[WEIGHTS_PUBLISHED],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_msgs_per_subject=1,  # last value: a late worker reads the current version
            duplicate_window=DUPLICATE_WINDOW_S,
        ),
        StreamConfig(
            name=HOSTS_STREAM,
            subjects=[f"{SCHED_ASSIGN_PREFIX}.*"],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_msgs_per_subject=1,  # last value: a restarted host agent reads its current assignment
            duplicate_window=DUPLICATE_WINDOW_S,
        ),
        dead_stream(),
    ))


def __getattr__(name: str):
    # `subjects.STREAMS` is read at each access, not at import: every service and test declares the
    # streams with the SF_TRAJECTORIES_* limits of the moment (ensure_streams updates in place, so two
    # processes with different limits would undo each other's; a stack gives all the same environment)
    if name == "STREAMS":
        return streams()
    raise AttributeError(name)


CHAT_CANCEL = "sf.chat.cancel"  # gateway -> every trajectory replica: the agent went away
