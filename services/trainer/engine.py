"""The DeepSpeed training engine: an HF causal LM, a client AdamW, one RL step at a time.

Owns the model on this rank:
- loading the HF directory vLLM loads (`AutoModelForCausalLM`), wrapping it in
  DeepSpeed with ZeRO stage 0-3, gloo on CPU and NCCL on CUDA;
- `logprobs(batch)`: log-probabilities of the taken tokens;
- `train_step(batches)`: the decoupled-PPO step with gradient accumulation over
  this rank's micro-batches (one optimizer step per PPO epoch), ranks kept in
  lock-step;
- `save_hf(dir)`: an HF safetensors snapshot (ZeRO-3 parameters gathered) that
  vLLM can load, with the tokenizer files copied from the source directory;
- `save_checkpoint`/`load_checkpoint`: DeepSpeed checkpoints (model, optimizer,
  step) plus a caller-owned client state, with retention;
- `offload`/`reload`: free the device while the host is lent to rollout (DeepSpeed
  `offload_states`/`reload_states` where they exist, else a timed no-op, see
  `offload_support`).

It does not know NATS, trajectories, weight versions or which data was consumed:
the caller passes micro-batches in and a client state dict to persist.

Every method that runs the model or a collective must be called on all ranks.

Why a client `torch.optim.AdamW`: DeepSpeed's own "AdamW" JIT-builds FusedAdam
(~40 s on CPU) and optimizer offload builds cpu_adam; the client optimizer builds
nothing and is what the plain-PyTorch reference uses.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from transformers import AutoModelForCausalLM

from services.trainer.algorithms import merge_metrics, policy_loss
from services.trainer.batching import MicroBatch, empty_micro_batch
from services.trainer.config import TrainerConfig

log = logging.getLogger(__name__)

CLIENT_KEY = "seamlessflow"  # our client state lives under one key; DeepSpeed adds its own beside it
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".index.json")


def init_distributed() -> None:
    """Join the process group (gloo on CPU, NCCL on CUDA); a lone process becomes a group of one."""
    if dist.is_initialized():
        return
    init, rank, world = None, -1, -1  # under torchrun/deepspeed: env://, as they set it
    if "RANK" not in os.environ:
        # a group of one, met through a file, not a TCP port: a port picked free and then bound by
        # torch can be taken in between (an outgoing connection's ephemeral port: EADDRINUSE)
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        rendezvous = tempfile.mkdtemp(prefix="sf-dist-")
        atexit.register(shutil.rmtree, rendezvous, True)
        init, rank, world = f"file://{rendezvous}/store", 0, 1
    cuda = get_accelerator().device_name() == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", auto_mpi_discovery=False,
                               init_method=init, rank=rank, world_size=world)


def offload_support(device: str, zero_stage: int, optimizer: object) -> str:
    """"" if DeepSpeed's `offload_states`/`reload_states` apply, else why not (offload and
    reload are then timed no-ops).

    DeepSpeed 0.19.8 implements them in its ZeRO optimizers only: stages 1 and 2
    (`DeepSpeedZeroOptimizer`) and 3 (`DeepSpeedZeroOptimizer_Stage3`). Stage 0 keeps the
    client optimizer (or `BF16_Optimizer`), which has neither. On CPU the states already
    live in host memory: there is nothing to free.
    """
    if device != "cuda":
        return f"nothing to free on {device}"
    if zero_stage == 0:
        return "ZeRO stage 0 has no offload_states (DeepSpeed 0.19 has it for stages 1-3)"
    if not callable(getattr(optimizer, "offload_states", None)):
        return f"{type(optimizer).__name__} has no offload_states"
    return ""


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool):
    """[B, T, V] logits -> ([B, T] logprob of each target, [B, T] entropy or None)."""
    logsm = logits.float().log_softmax(-1)
    logp = logsm.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logsm.exp() * logsm).sum(-1) if with_entropy else None
    return logp, entropy


class TrainEngine:
    def __init__(self, cfg: TrainerConfig):
        # 1. process group and device
        self.cfg = cfg
        self.algo = cfg.algo()
        init_distributed()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        accel = get_accelerator()
        cuda = accel.device_name() == "cuda"
        self.bf16 = cfg.dtype == "bf16" or (cfg.dtype == "auto" and cuda)
        if self.bf16 and not cuda:
            raise ValueError("bf16 training is for CUDA; use dtype=fp32 on CPU")
        torch.manual_seed(cfg.seed)

        # 2. the HF model (fp32 master weights; DeepSpeed casts for bf16)
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(cfg.model_dir, dtype=torch.float32)
        model.config.use_cache = False
        self.pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                      eps=cfg.adam_eps, weight_decay=cfg.weight_decay)

        # 3. DeepSpeed. Micro-batch counts vary per step, so the accumulation boundary is
        # set by hand (gradient_accumulation_steps=1 keeps DeepSpeed from rescaling the loss).
        ds_config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": cfg.grad_clip,
            "zero_optimization": {"stage": cfg.zero_stage},
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": self.bf16},
            "steps_per_print": 2**31 - 1,
        }
        # Linear warm-up: AdamW's first steps move every weight by ~lr whatever its gradient,
        # which wrecks a small policy at RL learning rates. DeepSpeed steps it per update and
        # keeps it in the checkpoint.
        warmup = max(cfg.lr_warmup_steps, 0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                               config=ds_config)
        self.device = self.engine.device
        self.ref_model = self._load_reference() if self.algo.kl_coef else None
        self.offloaded = False  # between offload() and reload(): no step may run
        self._cuda = cuda
        self._no_offload = offload_support(accel.device_name(), cfg.zero_stage, self.engine.optimizer)
        self.init_seconds = time.perf_counter() - t0

    def _load_reference(self):
        # A frozen, unpartitioned copy: fine for small models; a large one wants its own ZeRO-3 inference engine.
        ref = AutoModelForCausalLM.from_pretrained(self.cfg.model_dir,
                                                   dtype=torch.bfloat16 if self.bf16 else torch.float32)
        return ref.to(self.device).eval().requires_grad_(False)

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def global_steps(self) -> int:
        return self.engine.global_steps

    def _forward(self, model, mb: MicroBatch, with_entropy: bool):
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
        return token_logprobs(logits, mb.targets, with_entropy)

    @torch.no_grad()
    def logprobs(self, mb: MicroBatch) -> torch.Tensor:
        """[B, T] logprobs of the taken tokens under the current weights (padding positions are junk)."""
        return self._forward(self.engine, mb.to(self.device), False)[0]

    def train_step(self, batches: list[MicroBatch]) -> dict[str, float]:
        """One global-batch update from this rank's micro-batches; returns globally reduced metrics."""
        t0 = time.perf_counter()
        algo = self.algo
        # 1. Agree with the other ranks on the micro-batch count (ZeRO reduces per backward, so
        # every rank must run as many) and on the global token/sequence counts the loss divides by.
        counts = torch.tensor([sum(mb.num_tokens for mb in batches), sum(mb.num_seqs for mb in batches)],
                              dtype=torch.float64)
        n = torch.tensor([len(batches)], dtype=torch.long)
        if self.world > 1:
            counts, n = counts.to(self.device), n.to(self.device)
            dist.all_reduce(counts, op=dist.ReduceOp.SUM)
            dist.all_reduce(n, op=dist.ReduceOp.MAX)
        n = int(n.item())
        if n == 0:
            raise ValueError("train_step needs at least one micro-batch on some rank")
        batches = [mb.to(self.device) for mb in batches]
        batches += [empty_micro_batch(self.pad_id).to(self.device) for _ in range(n - len(batches))]
        # DeepSpeed averages gradients over ranks, so each rank divides by (global count / world).
        norm_tokens = float(counts[0]) / self.world
        norm_seqs = float(counts[1]) / self.world

        # 2. Reference logprobs are constant over the step.
        ref = [self._ref_logprobs(mb) for mb in batches] if self.ref_model is not None else [None] * n
        with_entropy = self.cfg.entropy_coef != 0.0 or self._track_entropy()

        # 3. PPO epochs. The proximal policy is the weights before this step's first update:
        # in epoch 0 that is exactly the current forward, detached, so no extra pass is needed.
        prox: list[torch.Tensor | None] = [None] * n
        parts, loss_sum = [], 0.0
        self.engine.train()
        for _epoch in range(self.cfg.ppo_epochs):
            for i, mb in enumerate(batches):
                self.engine.set_gradient_accumulation_boundary(i == n - 1)
                logp, entropy = self._forward(self.engine, mb, with_entropy)
                if prox[i] is None:
                    prox[i] = logp.detach()
                if entropy is not None and algo.entropy_coef == 0.0:
                    entropy = entropy.detach()
                loss, m = policy_loss(logp, prox[i], mb.behav_logprobs, mb.advantages, mb.loss_mask, algo,
                                      ref_logp=ref[i], entropy=entropy, num_tokens=norm_tokens,
                                      num_seqs=norm_seqs)
                self.engine.backward(loss)
                self.engine.step()
                parts.append(m)
                loss_sum += float(loss.detach())

        # 4. Metrics over all ranks.
        metrics = self._reduce_metrics(merge_metrics(parts))
        metrics["loss"] = self._reduce_sum(loss_sum) / self.world / self.cfg.ppo_epochs
        grad_norm = self.engine.get_global_grad_norm()
        if grad_norm is not None:
            metrics["grad_norm"] = float(grad_norm)
        metrics["tokens"] = float(counts[0])  # trained tokens in the global batch (not x epochs)
        metrics["micro_batches"] = float(n)
        metrics["compute_s"] = time.perf_counter() - t0
        return metrics

    def _track_entropy(self) -> bool:
        # The entropy metric costs one more [B, T, V] tensor; skip it for large vocabularies.
        return self.module.config.vocab_size <= 65536

    @torch.no_grad()
    def _ref_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        return self._forward(self.ref_model, mb, False)[0]

    def _reduce_sum(self, x: float) -> float:
        if self.world == 1:
            return x
        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t)

    def _reduce_metrics(self, m: dict[str, float]) -> dict[str, float]:
        if self.world == 1:
            return m
        keys = sorted(m)
        tokens = m.get("tokens", 0.0)
        sums = torch.tensor([m[k] if k == "tokens" else m[k] * tokens for k in keys if not k.endswith("_max")],
                            dtype=torch.float64, device=self.device)
        maxes = torch.tensor([m[k] for k in keys if k.endswith("_max")] or [0.0], dtype=torch.float64,
                             device=self.device)
        dist.all_reduce(sums)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        mean_keys = [k for k in keys if not k.endswith("_max")]
        total = float(sums[mean_keys.index("tokens")])
        out = {k: float(v) if k == "tokens" else (float(v) / total if total else 0.0)
               for k, v in zip(mean_keys, sums.tolist())}
        out.update({k: float(v) for k, v in zip([k for k in keys if k.endswith("_max")], maxes.tolist())})
        return out

    # --- lending the device ---------------------------------------------------------------

    def offload(self) -> dict[str, float]:
        """Move this rank's optimizer states, master and model weights and gradient buffers to
        host memory, so a rollout engine can use the device. Run on every rank (the Runner
        broadcasts it); never between a step's micro-batches (the Runner runs one command at
        a time)."""
        t0 = time.perf_counter()
        if not self.offloaded:
            if self._no_offload:
                log.log(logging.WARNING if self._cuda else logging.DEBUG,
                        "offload is a no-op: %s", self._no_offload)
            else:
                self.engine.offload_states()
                get_accelerator().empty_cache()  # hand the freed blocks back to the driver
            self.offloaded = True
        return {"offload_s": time.perf_counter() - t0}

    def reload(self) -> dict[str, float]:
        """Undo `offload`: the states are back on the device and a step may run."""
        t0 = time.perf_counter()
        if self.offloaded:
            if not self._no_offload:
                self.engine.reload_states()
            self.offloaded = False
        return {"reload_s": time.perf_counter() - t0}

    # --- persistence -------------------------------------------------------------------

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor] | None:
        """Unpartitioned parameters and buffers on CPU (ZeRO-3 shards gathered); collective."""
        module = self.module
        state = None
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None,
                                               enabled=self.cfg.zero_stage == 3):
            if self.rank == 0 or not rank0_only:
                state = {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
        return state

    def save_hf(self, out_dir: str | Path) -> Path:
        """Write an HF safetensors snapshot vLLM can load; rank 0 writes, all ranks return after it is complete.

        The directory appears whole: it is written beside `out_dir` and renamed into place.
        """
        out = Path(out_dir)
        tmp = out.with_name(out.name + ".tmp")
        module = self.module
        state = self.full_state_dict(rank0_only=True)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            module.save_pretrained(tmp, state_dict=state)
            src = Path(self.cfg.model_dir)
            for f in src.iterdir():  # tokenizer, chat template: whatever the weights do not cover
                if f.is_file() and not f.name.endswith(_WEIGHT_FILES) and not (tmp / f.name).exists():
                    shutil.copy2(f, tmp / f.name)
            if out.exists():
                shutil.rmtree(out)
            tmp.rename(out)
        dist.barrier()
        return out

    def save_checkpoint(self, root: str | Path, client_state: dict) -> str:
        """Save model, optimizer and `client_state` under tag `step-<global_steps>`; keep the newest K."""
        tag = f"step-{self.global_steps:08d}"
        self.engine.save_checkpoint(str(root), tag=tag, client_state={CLIENT_KEY: client_state})
        if self.rank == 0 and self.cfg.keep_checkpoints > 0:
            tags = sorted(p for p in Path(root).iterdir() if p.is_dir() and p.name.startswith("step-"))
            for old in tags[: -self.cfg.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return tag

    def load_checkpoint(self, root: str | Path) -> dict | None:
        """Restore the newest checkpoint under `root`; returns its client state, or None if there is none."""
        if not (Path(root) / "latest").exists():
            return None
        path, client = self.engine.load_checkpoint(str(root))
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint under {root}")
        return client.get(CLIENT_KEY, {})
