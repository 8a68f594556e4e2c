"""Trainer settings: one flat, frozen Struct read from `SF_TRAINER_*` variables.

    cfg = load(TrainerConfig, prefix="SF_TRAINER_")   # SF_TRAINER_ZERO_STAGE=2 ...

Every default runs on one CPU laptop with the tiny model. The loss knobs are the
fields of `algorithms.AlgoConfig`, repeated here flat so the environment can set
them; `algo()` builds the nested config.
"""

from __future__ import annotations

import msgspec

from services.trainer.algorithms import AlgoConfig


class TrainerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model_dir: str = "var/model"  # the HF directory vLLM loads too
    # engine
    zero_stage: int = 0  # 0..3
    dtype: str = "auto"  # auto = bf16 on CUDA, fp32 on CPU; or "fp32", "bf16"
    lr: float = 1e-5
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    adam_eps: float = 1e-8
    grad_clip: float = 1.0  # 0 = off
    seed: int = 0
    ppo_epochs: int = 1  # optimizer steps over the same global batch
    # data
    group_size: int = 8  # trajectories per GRPO group
    groups_per_step: int = 4  # global batch, in groups
    micro_batch_tokens: int = 4096  # padded positions per micro-batch
    # checkpoints
    checkpoint_dir: str = "var/trainer/checkpoints"
    keep_checkpoints: int = 2
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

    def __post_init__(self):
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError("zero_stage must be 0, 1, 2 or 3")
        if self.dtype not in ("auto", "fp32", "bf16"):
            raise ValueError("dtype must be auto, fp32 or bf16")
        if self.ppo_epochs < 1 or self.groups_per_step < 1 or self.micro_batch_tokens < 2:
            raise ValueError("ppo_epochs and groups_per_step must be >= 1, micro_batch_tokens >= 2")
        self.algo()  # validate the loss knobs now, not at the first step

    def algo(self) -> AlgoConfig:
        names = [f.name for f in msgspec.structs.fields(AlgoConfig)]
        return AlgoConfig(**{n: getattr(self, n) for n in names})
