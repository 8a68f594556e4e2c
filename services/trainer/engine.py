"""The DeepSpeed training engine: an HF causal LM, a client AdamW, one RL step at a time.

Owns the model on this rank:
- loading the HF directory vLLM loads (`AutoModelForCausalLM`), wrapping it in
  DeepSpeed with ZeRO stage 0-3, gloo on CPU and NCCL on CUDA;
- `logprobs(batch)`: log-probabilities of the taken tokens;
- `train_step(batches)`: the decoupled-PPO step with gradient accumulation over
  this rank's micro-batches (one optimizer step per PPO epoch), ranks kept in
  lock-step;
- `save_hf(dir)`: an HF safetensors snapshot (ZeRO-3 parameters gathered) that
  vLLM can load, with the tokenizer files copied from the source directory; under
  LoRA (`lora.py`, SF_TRAINER_LORA_RANK > 0) a PEFT adapter directory instead, or
  the merged weights with `lora_publish=merged`;
- `send_weights(sender, round, plan)`: stream the parameters to rollout workers over the network
  (shared/weightxfer.py), one layer group at a time (under ZeRO-3 one group gathered, copied to
  host memory, sent and released before the next): never the whole model at once;
- `save_checkpoint`/`load_checkpoint`: DeepSpeed checkpoints (model, optimizer,
  step) plus a caller-owned client state, with retention;
- `offload`/`reload`: free the device while the host is lent to rollout (DeepSpeed
  `offload_states`/`reload_states` where they exist, else a timed no-op, see
  `offload_support`), the reference model with it.

Across hosts (`torchrun --nnodes N`): each rank knows its host (`host_name`) and every
rank's (`rank_hosts`, gathered once at start); the runner offloads and reloads one host's
ranks only. With `node_local_checkpoints` each node's local rank 0 writes the model states
into that node's own checkpoint dir (DeepSpeed `use_node_local_storage`); DeepSpeed writes
`latest` on global rank 0 alone, so the tag to resume from is decided there and broadcast.
For large models: `zero_init` builds the model already partitioned (ZeRO-3, through
transformers' `HfDeepSpeedConfig`), `gradient_checkpointing` trades compute for activation
memory, `ref_offload` keeps the reference model in host memory between steps, and the HF
export gathers ZeRO-3 parameters one layer at a time onto rank 0 (DeepSpeed's consolidated
16-bit state dict) instead of the whole model on every rank.

It does not know NATS, trajectories, weight versions or which data was consumed:
the caller passes micro-batches in and a client state dict to persist.

Every method that runs the model or a collective must be called on all ranks.

Why a client `torch.optim.AdamW` (optim.py): DeepSpeed's own "AdamW" JIT-builds FusedAdam
(~40 s on CPU) and optimizer offload builds cpu_adam; the client optimizer builds
nothing and is what the plain-PyTorch reference uses. Under multi-LoRA it holds one
param group per role, and a role with no samples in a step sits that step out.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from transformers import AutoModelForCausalLM

from services.trainer import lora, optim
from shared import adapters
from services.trainer.algorithms import merge_metrics, policy_loss
from services.trainer.batching import MicroBatch, empty_micro_batch
from services.trainer.config import TrainerConfig
from shared import weightxfer
from shared.weightwire import ParamSpec, TransferPlan, make_plan

log = logging.getLogger(__name__)

CLIENT_KEY = "seamlessflow"  # our client state lives under one key; DeepSpeed adds its own beside it
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".index.json")


def init_distributed() -> None:
    """Join the process group (gloo on CPU, NCCL on CUDA); a lone process becomes a group of one."""
    if dist.is_initialized():
        return
    init, rank, world = None, -1, -1  # under torchrun/deepspeed: env://, as they set it
    if "MASTER_ADDR" not in os.environ:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise RuntimeError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but MASTER_ADDR is not set: start "
                               "the ranks with torchrun/deepspeed or set MASTER_ADDR and MASTER_PORT")
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


def host_name(cfg: TrainerConfig) -> str:
    """The host this rank runs on: SF_TRAINER_HOST, else the host agent's SF_HOST_ID, else the hostname."""
    return cfg.host or os.environ.get("SF_HOST_ID", "") or socket.gethostname()


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


class LendingUnsupported(RuntimeError):
    """The trainer takes part in lending but could not free its device for the lent host's vLLM."""


def lending_refusal(device: str, zero_stage: int, scheduler_gate: bool) -> str:
    """"" unless this trainer takes part in lending (`scheduler_gate`) on a device it cannot free.

    Refused at start-up, not at the first lend: ZeRO stage 0 has no offload_states, so a lent
    host's vLLM would start beside the trainer's full states and run the GPU out of memory."""
    if scheduler_gate and device == "cuda" and zero_stage == 0:
        return ("lending a train host needs the trainer to offload its states, and ZeRO stage 0 cannot "
                "(DeepSpeed has offload_states for stages 1-3): set SF_TRAINER_ZERO_STAGE to 1, 2 or 3, "
                "or run without lending (SF_TRAINER_SCHEDULER_GATE=false, no rollout tag on train hosts)")
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
        if why := lending_refusal(get_accelerator().device_name(), cfg.zero_stage, cfg.scheduler_gate):
            raise LendingUnsupported(why)  # before the process group and the model: at once, on every rank
        init_distributed()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.host = host_name(cfg)
        self.rank_hosts = self._gather_hosts()  # rank -> host, the same list on every rank
        accel = get_accelerator()
        cuda = accel.device_name() == "cuda"
        self.bf16 = cfg.dtype == "bf16" or (cfg.dtype == "auto" and cuda)
        if self.bf16 and not cuda:
            raise ValueError("bf16 training is for CUDA; use dtype=fp32 on CPU")
        torch.manual_seed(cfg.seed)

        # 2. DeepSpeed's config. Micro-batch counts vary per step, so the accumulation boundary is
        # set by hand (gradient_accumulation_steps=1 keeps DeepSpeed from rescaling the loss).
        ds_config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": cfg.grad_clip,
            "zero_optimization": {"stage": cfg.zero_stage},
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": self.bf16},
            "steps_per_print": 2**31 - 1,
            "checkpoint": {"use_node_local_storage": cfg.node_local_checkpoints},
        }

        # 3. the HF model (fp32 master weights; DeepSpeed casts for bf16). With zero_init, transformers
        # sees the live HfDeepSpeedConfig and builds it under deepspeed.zero.Init: each rank holds its
        # partition only, never the whole fp32 model.
        t0 = time.perf_counter()
        self._hf_ds = _hf_deepspeed_config(ds_config) if cfg.zero_init else None  # kept alive on purpose
        model = AutoModelForCausalLM.from_pretrained(cfg.model_dir, dtype=torch.float32)
        model.config.use_cache = False
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        # LoRA hook: a PEFT model whose adapter alone requires grad (lora.py); None = full fine-tune
        self.lora = lora.lora_spec(cfg)
        self.roles = adapters.parse_roles(cfg.lora_roles) if self.lora is not None else ()  # multi-LoRA
        if self.lora is not None:
            model = lora.wrap(model, self.lora, cfg.model_dir, self.roles)
        # multi-LoRA: one param group per role, so a role with no samples in a step sits it out (optim.py)
        optimizer, self._sit_out = optim.adamw(cfg, self._param_groups(model))
        # Linear warm-up: AdamW's first steps move every weight by ~lr whatever its gradient,
        # which wrecks a small policy at RL learning rates. DeepSpeed steps it per update and
        # keeps it in the checkpoint.
        warmup = max(cfg.lr_warmup_steps, 0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                               config=ds_config)
        self.device = self.engine.device
        self._adapter_params = lora.adapter_params(self.module) if self.roles else {}
        # the KL reference: under LoRA the same weights with the adapter disabled, no second copy
        self.ref_model = self._load_reference() if self.algo.kl_coef and self.lora is None else None
        self.kl_reference = bool(self.algo.kl_coef)
        self.offloaded = False  # between offload() and reload(): no step may run
        self._cuda = cuda
        self._no_offload = offload_support(accel.device_name(), cfg.zero_stage, self.engine.optimizer)
        self.init_seconds = time.perf_counter() - t0

    def _param_groups(self, model: torch.nn.Module) -> dict[str, list[torch.nn.Parameter]]:
        trainable = [p for p in model.parameters() if p.requires_grad]
        if not self.roles:
            return {"": trainable}
        by_role = lora.adapter_params(model)
        groups = {role: by_role[role] for role in self.roles}
        if sum(len(ps) for ps in groups.values()) != len(trainable):
            raise RuntimeError("multi-LoRA: a trainable parameter belongs to no role's adapter")
        return groups

    def _load_reference(self):
        # A frozen, unpartitioned copy, only when the loss has a KL term. With ref_offload it lives in host
        # memory and visits the device for each step's reference pass; a model too large for one device
        # wants its own ZeRO-3 inference engine instead.
        ref = AutoModelForCausalLM.from_pretrained(self.cfg.model_dir,
                                                   dtype=torch.bfloat16 if self.bf16 else torch.float32)
        return ref.to("cpu" if self.cfg.ref_offload else self.device).eval().requires_grad_(False)

    def _gather_hosts(self) -> list[str]:
        if self.world == 1:
            return [self.host]
        hosts: list = [None] * self.world
        dist.all_gather_object(hosts, self.host)
        return hosts

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def global_steps(self) -> int:
        return self.engine.global_steps

    def _forward(self, model, mb: MicroBatch, with_entropy: bool):
        if self.roles:  # multi-LoRA: this micro-batch's role picks the adapter (an empty one keeps the last)
            lora.activate(self.module, mb.adapter or lora.active(self.module))
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
        # 1. Agree with the other ranks on the micro-batch count and the global counts the loss divides by.
        n, counts = self._agree(batches)
        batches = [mb.to(self.device) for mb in batches]
        batches += [empty_micro_batch(self.pad_id).to(self.device) for _ in range(n - len(batches))]
        # DeepSpeed averages gradients over ranks, so each rank divides by (global count / world).
        norm_tokens = float(counts[0]) / self.world
        norm_seqs = float(counts[1]) / self.world
        # A role with no loss tokens on any rank gets an exact zero gradient; its adapter and Adam state
        # must come out of the step as they went in, which a zero step would not give (optim.py).
        self._sit_out.roles = frozenset(r for r, c in zip(self.roles, counts[2:].tolist()) if c == 0)

        # 2. Reference logprobs are constant over the step.
        ref = self._ref_pass(batches) if self.kl_reference else [None] * n
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
                self.engine.backward(loss + self._idle_term())
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

    def _agree(self, batches: list[MicroBatch]) -> tuple[int, torch.Tensor]:
        """The micro-batch count every rank runs (ZeRO reduces per backward, so every rank must run as
        many) and the global [loss tokens, sequences, each role's loss tokens...] (the same on every rank)."""
        counts = torch.tensor([sum(mb.num_tokens for mb in batches), sum(mb.num_seqs for mb in batches),
                               *(sum(mb.num_tokens for mb in batches if mb.adapter == r) for r in self.roles)],
                              dtype=torch.float64)
        n = torch.tensor([len(batches)], dtype=torch.long)
        if self.world > 1:
            counts, n = counts.to(self.device), n.to(self.device)
            dist.all_reduce(counts, op=dist.ReduceOp.SUM)
            dist.all_reduce(n, op=dist.ReduceOp.MAX)
        if int(n.item()) == 0:
            raise ValueError("train_step needs at least one micro-batch on some rank")
        return int(n.item()), counts.cpu()

    def _idle_term(self) -> torch.Tensor | float:
        """Multi-LoRA: the other roles' adapters get an exact zero gradient, never this batch's."""
        return lora.idle_term(self._adapter_params, lora.active(self.module)) if self.roles else 0.0

    def _track_entropy(self) -> bool:
        # The entropy metric costs one more [B, T, V] tensor; skip it for large vocabularies.
        return self.module.config.vocab_size <= 65536

    @torch.no_grad()
    def _ref_pass(self, batches: list[MicroBatch]) -> list[torch.Tensor]:
        if self.ref_model is None:  # LoRA: the base policy is the engine with its adapter off
            with lora.adapter_disabled(self.module):
                return [self._forward(self.engine, mb, False)[0] for mb in batches]
        visiting = self.cfg.ref_offload and self.device.type != "cpu"
        if visiting:
            self.ref_model.to(self.device)
        try:
            return [self._forward(self.ref_model, mb, False)[0] for mb in batches]
        finally:
            if visiting:
                self.ref_model.to("cpu")

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
            if self.ref_model is not None and self._cuda:
                self.ref_model.to("cpu")
            if self._cuda:
                get_accelerator().empty_cache()  # hand the freed blocks back to the driver
            self.offloaded = True
        return {"offload_s": time.perf_counter() - t0}

    def reload(self) -> dict[str, float]:
        """Undo `offload`: the states are back on the device and a step may run."""
        t0 = time.perf_counter()
        if self.offloaded:
            if not self._no_offload:
                self.engine.reload_states()
            if self.ref_model is not None and self._cuda and not self.cfg.ref_offload:
                self.ref_model.to(self.device)
            self.offloaded = False
        return {"reload_s": time.perf_counter() - t0}

    # --- persistence -------------------------------------------------------------------

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor] | None:
        """Unpartitioned parameters and buffers on CPU (ZeRO-3 shards gathered); collective.

        rank0_only under ZeRO-3 is DeepSpeed's consolidated 16-bit state dict: one layer gathered at a time
        and moved to rank 0's host memory, so no device ever holds the whole model (the training dtype:
        bf16 on CUDA, fp32 on CPU)."""
        module = self.module
        if rank0_only and self.cfg.zero_stage == 3:
            return self.engine._zero3_consolidated_16bit_state_dict()  # noqa: SLF001  DeepSpeed's HF-export path
        state = None
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None,
                                               enabled=self.cfg.zero_stage == 3):
            if self.rank == 0 or not rank0_only:
                state = {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
        return state

    def transfer_plan(self, version: int, wire_dtype: str = "", bucket_bytes: int = 256 << 20) -> TransferPlan:
        """The plan of a network round: every parameter once (tied ones once), in module order, at its
        full (unpartitioned) shape; `wire_dtype` "" sends each in its own dtype."""
        specs = []
        for name, p in self.module.named_parameters():
            shape = tuple(getattr(p, "ds_shape", p.shape))  # ZeRO-3 keeps the full shape beside the shard
            specs.append(ParamSpec(name, wire_dtype or str(p.dtype).removeprefix("torch."), shape))
        return make_plan(version, specs, bucket_bytes)

    def send_weights(self, sender: weightxfer.WeightSender | None, rnd: weightxfer.Round | None,
                     plan: TransferPlan) -> int:
        """Stream `plan`'s groups; rank 0 passes the sender and its round, the other ranks None (they
        only join each group's ZeRO-3 gather). Collective; returns the bytes rank 0 sent."""
        params = [p for _, p in self.module.named_parameters()]

        def group_tensors(indices: tuple[int, ...]) -> dict[int, torch.Tensor]:
            with deepspeed.zero.GatheredParameters([params[i] for i in indices], modifier_rank=None,
                                                   enabled=self.cfg.zero_stage == 3):
                # a host copy of this group only, cast to the wire dtype in the same pass (so it is sent from
                # its own memory, never packed again): the gather is released when the block ends
                return {i: params[i].detach().to("cpu", dtype=getattr(torch, plan.params[i].dtype), copy=True)
                        for i in indices} if self.rank == 0 else {}

        if self.rank == 0 and sender is not None and rnd is not None:
            return sender.send(rnd, plan, group_tensors)
        weightxfer.stream(plan, group_tensors, None)
        return 0

    def save_hf(self, out_dir: str | Path) -> Path:
        """Write an HF safetensors snapshot vLLM can load; rank 0 writes, all ranks return after it is complete.

        The directory appears whole: it is written beside `out_dir` and renamed into place.
        """
        out = Path(out_dir)
        tmp = out.with_name(out.name + ".tmp")
        if self.lora is not None and self.cfg.lora_publish == "adapter":
            self._save_adapter(tmp)  # LoRA hook: the version is the adapter alone (MBs)
        else:
            self._save_full(tmp)
        if self.rank == 0:
            if out.exists():
                shutil.rmtree(out)
            tmp.rename(out)
        dist.barrier()
        return out

    def _save_full(self, tmp: Path) -> None:
        module = self.module
        state = self.full_state_dict(rank0_only=True)
        if self.rank != 0:
            return
        shutil.rmtree(tmp, ignore_errors=True)
        if self.lora is not None:  # lora_publish=merged: base + adapter folded, plain HF names
            state = adapters.merged_state_dict(state, self.lora.scaling)
            module = module.get_base_model()
        module.save_pretrained(tmp, state_dict=state)
        src = Path(self.cfg.model_dir)
        for f in src.iterdir():  # tokenizer, chat template: whatever the weights do not cover
            if f.is_file() and not f.name.endswith(_WEIGHT_FILES) and not (tmp / f.name).exists():
                shutil.copy2(f, tmp / f.name)

    def _save_adapter(self, tmp: Path) -> None:
        """One adapter dir; multi-LoRA: one per role under `tmp/<role>/` (shared/checkpoint.role_adapters)."""
        trainable = [p for p in self.module.parameters() if p.requires_grad]
        names = self.roles or (lora.DEFAULT,)
        with deepspeed.zero.GatheredParameters(trainable, modifier_rank=None, enabled=self.cfg.zero_stage == 3):
            states = {a: lora.trainable_state(self.module, a) for a in names} if self.rank == 0 else {}
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            for a, state in states.items():
                lora.save_adapter(self.module, tmp / a if self.roles else tmp, state, a)

    def save_checkpoint(self, root: str | Path, client_state: dict) -> str:
        """Save model, optimizer and `client_state` under tag `step-<global_steps>`; keep the newest K."""
        tag = f"step-{self.global_steps:08d}"
        # LoRA: the frozen base is the model directory itself; the checkpoint holds the adapter
        # and its optimizer state only
        self.engine.save_checkpoint(str(root), tag=tag, client_state={CLIENT_KEY: client_state},
                                    exclude_frozen_parameters=self.lora is not None)
        if self.lora is not None and self.rank == 0:  # for `seamlessflow export --adapter` (multi-LoRA: per role)
            for a in self.roles or (lora.DEFAULT,):
                out = Path(root) / tag / a if self.roles else Path(root) / tag
                out.mkdir(parents=True, exist_ok=True)
                lora.save_adapter_config(self.module, out, a)
        if self._checkpoint_writer() and self.cfg.keep_checkpoints > 0:
            tags = sorted(p for p in Path(root).iterdir() if p.is_dir() and p.name.startswith("step-"))
            for old in tags[: -self.cfg.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return tag

    def _checkpoint_writer(self) -> bool:
        """The rank that prunes old checkpoints in its dir: each node's first with node-local dirs."""
        return self.local_rank == 0 if self.cfg.node_local_checkpoints else self.rank == 0

    def load_checkpoint(self, root: str | Path) -> dict | None:
        """Restore the newest checkpoint under `root`; returns its client state, or None if there is none.

        Rank 0 decides (DeepSpeed writes `latest` there only) and broadcasts the tag; every rank then
        checks that its own `root` holds that tag, and all fail together if one does not."""
        tag = resume_tag(root) if self.rank == 0 else None
        if self.world > 1:
            box = [tag]
            dist.broadcast_object_list(box, src=0)
            tag = box[0]
        if tag is None:
            return None
        here = (Path(root) / tag).is_dir()
        missing = [h for h, ok in zip(self.rank_hosts, self._gather_flag(here)) if not ok]
        if missing:
            raise RuntimeError(f"rank 0 resumes from {tag}, but {root} on {', '.join(sorted(set(missing)))} "
                               "does not hold it (a node-local dir needs node_local_checkpoints on every node)")
        path, client = self.engine.load_checkpoint(str(root), tag=tag, load_module_strict=self.lora is None)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint {tag} under {root}")
        return client.get(CLIENT_KEY, {})

    def _gather_flag(self, flag: bool) -> list[bool]:
        if self.world == 1:
            return [flag]
        flags: list = [None] * self.world
        dist.all_gather_object(flags, flag)
        return flags


def resume_tag(root: str | Path) -> str | None:
    """The tag DeepSpeed's `latest` file names under `root`, or None when there is no checkpoint."""
    latest = Path(root) / "latest"
    if not latest.is_file():
        return None
    return latest.read_text().strip() or None


def _hf_deepspeed_config(ds_config: dict):
    """transformers' handle that makes `from_pretrained` build under `deepspeed.zero.Init` (ZeRO-3)."""
    from transformers.integrations import HfDeepSpeedConfig

    return HfDeepSpeedConfig(ds_config)
