"""Trainer settings: one flat, frozen Struct read from `SF_TRAINER_*` variables.

    cfg = load(TrainerConfig, prefix="SF_TRAINER_")   # SF_TRAINER_ZERO_STAGE=2 ...

Every default runs on one CPU laptop with the tiny model. The loss knobs are the
fields of `algorithms.AlgoConfig`, repeated here flat so the environment can set
them; `algo()` builds the nested config. The service knobs (consumer, weight store,
checkpoint cadence, metrics) only matter to `service.py`; `load_config()` is what
`__main__` uses: SF_TRAINER_* plus flags, with the weight store falling back to the
operator CLI's SF_WEIGHTS_DIR.
"""

from __future__ import annotations

import os
from typing import Literal

import msgspec

from services.trainer.algorithms import AlgoConfig
from shared import subjects, timeouts
from shared.config import ConfigError, load


class TrainerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model_dir: str = "var/model"  # the HF directory vLLM loads too
    # engine
    zero_stage: int = 0  # 0..3
    dtype: str = "auto"  # auto = bf16 on CUDA, fp32 on CPU; or "fp32", "bf16"
    lr: float = 1e-5
    lr_warmup_steps: int = 0  # linear warm-up of the learning rate over this many optimizer steps
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0  # 0 = off
    seed: int = 0
    # large models (see engine.py)
    zero_init: bool = False  # build the model partitioned (deepspeed.zero.Init via HfDeepSpeedConfig); ZeRO-3 only
    gradient_checkpointing: bool = False  # recompute activations in the backward pass
    ref_offload: bool = False  # the reference model (kl_coef != 0) stays in host memory between steps
    ppo_epochs: int = 1  # optimizer steps over the same global batch
    # LoRA (services/trainer/lora.py): rank 0 = full fine-tune
    lora_rank: int = 0
    lora_alpha: float = 0.0  # 0 = 2 x rank
    lora_dropout: float = 0.0
    lora_targets: str = "all"  # attn, mlp, all, or module names separated by commas
    lora_publish: str = "adapter"  # a version is an adapter dir (MBs), or "merged": a full HF checkpoint
    # multi-LoRA: one adapter per agent role, "planner,solver" (a session's metadata "role" picks one);
    # "" = one adapter for every session
    lora_roles: str = ""
    # data
    group_size: int = 8  # trajectories per GRPO group
    groups_per_step: int = 4  # global batch, in groups
    micro_batch_tokens: int = 4096  # padded positions per micro-batch
    # checkpoints
    checkpoint_dir: str = "var/trainer/checkpoints"
    keep_checkpoints: int = 2
    node_local_checkpoints: bool = False  # checkpoint_dir is each node's own disk (torchrun --nnodes N, no shared fs)
    # loss (see algorithms.AlgoConfig)
    advantage: str = "grpo"
    std_normalize: bool = True
    group_baseline: bool = False
    adv_eps: float = 1e-6
    clip_low: float = 0.2
    clip_high: float = 0.2
    decoupled: bool = True
    tis: bool = True
    tis_cap: float = 2.0
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    aggregation: str = "token-mean"
    drop_uniform_groups: bool = False  # dynamic sampling: all-equal-reward groups leave the batch
    # service: consuming sf.traj.completed
    durable: str = subjects.TRAINER_DURABLE  # the trajectory manager reads this consumer's backlog for admission control
    ack_wait: float = 60.0  # seconds; held messages get in_progress() every ack_wait/3
    max_deliver: int = 10
    max_ack_pending: int = 10000  # must exceed what a checkpoint interval holds unacked
    fetch_batch: int = 64
    fetch_timeout: float = 1.0  # seconds one fetch waits (bounds the reaction to quit)
    group_timeout: float = 900.0  # an incomplete group older than this is dropped (terminated); 0 = never
    max_steps: int = 0  # exit after this many steps in total (0 = run until told to quit)
    # service: cadences and retention
    checkpoint_every: int = 1  # steps; messages are acked only once a checkpoint covers them
    publish_every: int = 1  # steps between published weight versions
    publish_retry_s: float = 90.0  # seconds an announcement is retried while NATS is away; then the trainer stops
    weights_dir: str = ""  # the weight store root; "" = $SF_WEIGHTS_DIR or var/weights
    # how versions reach rollout workers: "disk" (a store dir every rollout host reads) or "network"
    # (a transfer round from rank 0, shared/weightxfer.py; no rollout host reads a trainer disk)
    weights_transport: str = "disk"
    weights_bind: str = "127.0.0.1"  # network: rank 0's address, reachable from every rollout host
    weights_port: int = 0  # network: its TCPStore port; 0 = a free one (announced with each version)
    weights_bucket_mb: int = 256  # network: bytes per bucket on the wire
    weights_wire_dtype: str = ""  # network: "" = each parameter's dtype; "bfloat16" halves fp32's bytes
    weights_join_window: float = 5.0  # network: seconds a round waits for the live workers to join
    keep_versions: int = 2  # newest versions kept besides those a rollout worker still serves
    worker_stale_after: float = timeouts.HEARTBEAT_STALE_AFTER  # an older worker heartbeat no longer pins its version
    ledger_keep_steps: int = 10000  # trained ids older than this many steps leave the ledger; 0 = keep all
    # service: metrics
    metrics_port: int = 9401  # Prometheus /metrics on rank 0; 0 = off
    metrics_host: str = "127.0.0.1"  # 0.0.0.0 lets a Prometheus on another host scrape it
    tensorboard_dir: str = "var/trainer/tb"  # "" = off
    audit_log: str = "var/trainer/trained.jsonl"  # one JSON line per step with the trained ids; "" = off
    # service: the tag scheduler (TrainerStatus heartbeats on sf.trainer.status are always sent)
    host: str = ""  # SF_TRAINER_HOST: the host (SF_HOST_ID) this rank runs on, reported in TrainerStatus.hosts
    scheduler_gate: bool = False  # before each step, ask sf.sched.gate to reclaim our hosts (TrainGate)
    gate_timeout: float = 30.0  # seconds the scheduler may take to grant; then see gate_fallback
    # what an ungranted gate leads to: "compute" anyway (logged), or "wait" and ask again (logged) until granted;
    # "auto" = wait on CUDA, where computing beside a lent host's vLLM can run the device out of memory
    gate_fallback: Literal["auto", "compute", "wait"] = "auto"
    # a scheduler answered before and none answers now: a leader change (a standby leads within its lease,
    # 3 s, plus 0.5 s: services/scheduler/leader.py), so ask again for this long before the fallback
    gate_leader_gap: float = 6.0

    def __post_init__(self):
        if self.weights_transport not in ("disk", "network"):
            raise ValueError("weights_transport must be disk or network")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError("zero_stage must be 0, 1, 2 or 3")
        if self.dtype not in ("auto", "fp32", "bf16"):
            raise ValueError("dtype must be auto, fp32 or bf16")
        self._check_lora()
        if self.ppo_epochs < 1 or self.groups_per_step < 1 or self.micro_batch_tokens < 2:
            raise ValueError("ppo_epochs and groups_per_step must be >= 1, micro_batch_tokens >= 2")
        if self.group_size < 1 or self.checkpoint_every < 1 or self.publish_every < 1 or self.keep_versions < 1:
            raise ValueError("group_size, checkpoint_every, publish_every and keep_versions must be >= 1")
        if self.ack_wait <= 0 or self.fetch_timeout <= 0 or self.fetch_batch < 1 or self.max_deliver < 1:
            raise ValueError("ack_wait and fetch_timeout must be > 0, fetch_batch and max_deliver >= 1")
        if self.zero_init and self.zero_stage != 3:
            raise ValueError("zero_init partitions parameters at construction: it needs zero_stage=3")
        if self.gate_timeout <= 0:
            raise ValueError("gate_timeout must be > 0")
        if not 0 <= self.publish_retry_s < subjects.DUPLICATE_WINDOW_S:
            raise ValueError(f"publish_retry_s must be at least 0 and below {subjects.DUPLICATE_WINDOW_S:g}, the "
                             "WEIGHTS stream's duplicate window, which keeps a retried announcement from landing twice")
        held = self.group_size * self.groups_per_step * (self.checkpoint_every + 2)
        if 0 < self.max_ack_pending < held:
            raise ValueError(f"max_ack_pending={self.max_ack_pending} cannot hold a checkpoint interval's "
                             f"unacked trajectories ({held}); raise it or lower checkpoint_every")
        self.algo()  # validate the loss knobs now, not at the first step

    def _check_lora(self) -> None:
        if self.lora_rank < 0 or self.lora_alpha < 0 or not 0 <= self.lora_dropout < 1:
            raise ValueError("lora_rank and lora_alpha must be >= 0, lora_dropout in [0, 1)")
        if self.lora_publish not in ("adapter", "merged"):
            raise ValueError("lora_publish must be adapter or merged")
        if not self.lora_roles:
            return
        from shared.adapters import parse_roles

        parse_roles(self.lora_roles)  # raises ValueError on a bad name
        if self.lora_rank == 0:
            raise ValueError("lora_roles names one adapter per role: it needs lora_rank > 0")
        if self.lora_publish != "adapter" or self.weights_transport != "disk":
            raise ValueError("lora_roles publishes one adapter dir per role: it needs lora_publish=adapter and "
                             "weights_transport=disk")
        if self.zero_stage == 3:
            raise ValueError("lora_roles runs at ZeRO stage 0-2 (under ZeRO-3 a role's idle adapter would "
                             "change the partitioned parameters' fetch order every micro-batch)")

    def sessions_per_version(self) -> int:
        """Sessions (TrajectoryCompleted messages) trained per published version; declared in the
        consumer's metadata for the trajectory manager's admission control."""
        return self.group_size * self.groups_per_step * self.publish_every

    def algo(self) -> AlgoConfig:
        names = [f.name for f in msgspec.structs.fields(AlgoConfig)]
        return AlgoConfig(**{n: getattr(self, n) for n in names})


def load_config(env=None, **overrides) -> TrainerConfig:
    """SF_TRAINER_* plus overrides (CLI flags); the weight store defaults like the operator CLI's."""
    env = os.environ if env is None else env
    try:
        cfg = load(TrainerConfig, "SF_TRAINER_", env=env, **overrides)
    except ValueError as e:  # __post_init__ checks surface as ValidationError or ValueError
        raise ConfigError(str(e)) from None
    if not cfg.weights_dir:
        cfg = msgspec.structs.replace(cfg, weights_dir=env.get("SF_WEIGHTS_DIR", "var/weights"))
    return cfg
