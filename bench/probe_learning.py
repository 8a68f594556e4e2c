"""Offline probe: does the trainer's loss raise the reward of the built-in "reverse" task?

A single-process simulation of the real RL loop in plain torch + HF transformers: no
NATS, no vLLM, no DeepSpeed. Per step it samples `groups` prompts x `group_size`
answers from the current policy (temperature 1, top_k 0, top_p 1, at most 8 new
tokens, EOS kept in the answer and in the loss like the real system), scores them
with seamlessflow/demo/tasks.py, builds the global batch with the trainer's own code
(services/trainer/batching.py: build_global_batch -> micro_batches, i.e. the real
advantages, shift and loss mask) and runs the same update as
services/trainer/engine.py TrainEngine.train_step: per PPO epoch, gradient
accumulation over micro-batches of `policy_loss(...)` with the global token/sequence
normalisers, the proximal logprobs taken from epoch 0's forward, grad-norm clipping,
one AdamW step (betas/eps/weight decay from the flags) and a LambdaLR linear warm-up
stepped after each optimizer step. Rollout is on-policy (staleness 0, behaviour
logprobs = the sampling model's forward), so the TIS weight is exactly 1, unless
`--staleness K`: then step t samples from a copy of the policy after step max(0, t - K)
(behaviour logprobs and token versions are that copy's) and trains the current policy on it,
as the demo's trainer does with tokens K versions old (the TIS weight then is
min(pi_now / pi_behaviour, tis_cap)). Full fine-tune only.

Every `--eval-every` steps it evaluates on a fixed set of prompts (same prompts and,
via a fixed torch seed, the same sampling noise in every run): sampled reward at
temperature 1 and greedy reward.

Run (from the repo root, one core):

    # 1. build the tiny model and warm starts (same code and seeds as tests/conftest.py):
    .venv/bin/python bench/probe_learning.py prepare --dir /tmp/probe --targets 0.3 0.4
    # 2. one run (prints a line per step and a JSON summary):
    .venv/bin/python bench/probe_learning.py run --model /tmp/probe/warm0.3 --lr 3e-4 --warmup 5
    # 3. a sweep: a JSON list of option dicts (keys = run flags with _ for -), one JSON line each:
    .venv/bin/python bench/probe_learning.py sweep grid.json --out results.jsonl

Costs (one core): tiny model ~0.1 s/step at 32 samples, ~0.15 s at 64; a 60-step run with
7 evals of 256 prompts takes ~15-40 s. "small" model ~0.35 s/step.

What it found (tiny model, warm start target 0.3 = 75 SFT steps, eval 256 prompts):
sampled 0.36 / greedy 0.63 at the start; lr 1e-4 (no warm-up needed) is the best and
gives only about +0.10 in 60 steps (0.36 -> 0.45-0.47, 32 or 64 samples per step, 2 seeds);
lr >= 3e-4 loses greedy reward and lr 1e-3 collapses (answers truncated by an early EOS)
because the small-batch gradient is mostly noise (a 512-sample batch at lr 1e-3 does
not collapse). The "small" model from the same warm start gains +0.25 in 60 steps at lr 1e-4.

Flags of `run` mirror TrainerConfig (lr, lr_warmup_steps, beta1, beta2, adam_eps,
weight_decay, grad_clip, ppo_epochs, group_size, groups_per_step, advantage,
std_normalize, aggregation, entropy_coef, clip_low, clip_high, ...).

LoRA: `--lora-rank R [--lora-alpha A --lora-targets all]` builds the policy the way the
trainer does (`build_policy`: a TrainerConfig -> services/trainer/lora.py lora_spec + wrap,
the same PEFT wrapping, target sets and alpha default of 2 x rank; optim.adamw over the adapter's
parameters alone; the KL reference is the policy with its adapter disabled). Issue 27's side by
side (docs/history/benchmarks-log.md, "LoRA against full fine-tune"):

    .venv/bin/python bench/probe_learning.py run --model WARM --group-size 16 --groups-per-step 8 \
        --lr 2e-4 --lora-rank 8 --lora-targets all --seed 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from seamlessflow.demo.tasks import REVERSE_SHAPINGS, reverse_prompt, reverse_reward
from seamlessflow.demo.warmstart import _prompt_ids
from services.trainer import lora, optim
from services.trainer.algorithms import AlgoConfig, merge_metrics, policy_loss
from services.trainer.batching import build_global_batch, micro_batches
from services.trainer.config import TrainerConfig
from shared.messages.trajectory import Sample, TrajectoryCompleted

MAX_NEW = 8


def token_logprobs(logits, targets, with_entropy):
    """Copy of services/trainer/engine.py token_logprobs (that module imports DeepSpeed)."""
    logsm = logits.float().log_softmax(-1)
    logp = logsm.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logsm.exp() * logsm).sum(-1) if with_entropy else None
    return logp, entropy


def left_pad(prompts, pad_id):
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, attn, width


@torch.no_grad()
def generate(model, tok, prompts, do_sample=True):
    """Answer token lists (cut after the first EOS, EOS included), batched and left-padded."""
    ids, attn, width = left_pad(prompts, tok.pad_token_id)
    kw = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if do_sample else {"do_sample": False}
    out = model.generate(ids, attention_mask=attn, max_new_tokens=MAX_NEW, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, **kw)
    answers = []
    for row in out[:, width:].tolist():
        if tok.eos_token_id in row:
            row = row[: row.index(tok.eos_token_id) + 1]
        answers.append(row)
    return answers


@torch.no_grad()
def seq_logprobs(model, seqs, plens, pad_id):
    """Logprob of each answer token under `model` (the behaviour logprobs of the rollout)."""
    width = max(map(len, seqs))
    ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs])
    attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    logp, _ = token_logprobs(model(input_ids=ids, attention_mask=attn).logits[:, :-1], ids[:, 1:], False)
    out = []
    for b, (s, p) in enumerate(zip(seqs, plens)):
        out.append([0.0] * p + logp[b, p - 1: len(s) - 1].tolist())
    return out


class Evaluator:
    def __init__(self, tok, n=256, seed=12345):
        rng = random.Random(seed)
        self.tasks = [reverse_prompt(rng) for _ in range(n)]
        self.prompts = [_prompt_ids(tok, t) for t, _ in self.tasks]
        self.tok = tok
        self.seed = seed

    def __call__(self, model):
        model.eval()
        res = {}
        with torch.random.fork_rng():  # same sampling noise in every eval; training RNG untouched
            torch.manual_seed(self.seed)
            for name, sample in (("sampled", True), ("greedy", False)):
                answers = generate(model, self.tok, self.prompts, sample)
                texts = self.tok.batch_decode(answers, skip_special_tokens=True)
                res[name] = sum(reverse_reward(a, tgt) for a, (_, tgt) in zip(texts, self.tasks)) / len(texts)
                if sample:
                    res["eos_frac"] = sum(self.tok.eos_token_id in a for a in answers) / len(answers)
                    res["len"] = sum(len(a) for a in answers) / len(answers)
        return res


DEFAULTS = {
    "model": "/tmp/probe/warm0.3", "steps": 60, "seed": 0, "task_seed": 1, "eval_every": 10, "eval_n": 256,
    # TrainerConfig engine/data knobs (defaults: seamlessflow/demo/rl.py TRAINER_SETTINGS)
    "lr": 3e-4, "lr_warmup_steps": 5, "beta1": 0.9, "beta2": 0.999, "adam_eps": 1e-8, "weight_decay": 0.0,
    "grad_clip": 1.0, "ppo_epochs": 1, "group_size": 8, "groups_per_step": 4, "micro_batch_tokens": 4096,
    # AlgoConfig knobs
    "advantage": "grpo", "std_normalize": True, "group_baseline": False, "clip_low": 0.2, "clip_high": 0.2,
    "decoupled": True, "tis": True, "tis_cap": 2.0, "entropy_coef": 0.0, "aggregation": "token-mean",
    "drop_uniform_groups": False, "kl_coef": 0.0,
    # LoRA, the trainer's own (services/trainer/lora.py via TrainerConfig): rank 0 = full fine-tune;
    # alpha 0 = 2 x rank; targets: attn, mlp, all or module names separated by commas
    "lora_rank": 0, "lora_alpha": 0.0, "lora_targets": "all",
    # the reward the trainer sees: "answer" (tasks.answer_reward, what the demo reports) or another
    # shaping of tasks.REVERSE_SHAPINGS; batch_reward, loop_gain and the evals always use answer_reward
    "reward": "answer",
    # probe
    "name": "", "quiet": False, "save": "",  # save: write the final model here ("" = no)
    # off-policy emulation (issue 26): step t samples from the policy of step max(0, t - staleness) (a
    # snapshot of its weights), its behaviour logprobs and token versions that snapshot's, and trains
    # the current policy on it, as the demo's trainer does with tokens `staleness` versions old
    "staleness": 0,
}


def rollout(model, tok, rng: random.Random, o: dict, step: int, pad_id: int) -> tuple[list, list[float], list]:
    """G prompts x group_size samples from `model` (the policy of version `step`): (groups, rewards, answers)."""
    model.eval()
    tasks = [reverse_prompt(rng) for _ in range(o["groups_per_step"])]
    prompts = [_prompt_ids(tok, t) for t, _ in tasks for _ in range(o["group_size"])]
    answers = generate(model, tok, prompts)
    texts = tok.batch_decode(answers, skip_special_tokens=True)
    targets = [tgt for _, tgt in tasks for _ in range(o["group_size"])]
    rewards = [reverse_reward(a, t) for a, t in zip(texts, targets)]  # what the demo reports
    shaped = REVERSE_SHAPINGS[o["reward"]]
    train_rewards = [shaped(a, t) for a, t in zip(texts, targets)]
    seqs = [p + a for p, a in zip(prompts, answers)]
    behav = seq_logprobs(model, seqs, [len(p) for p in prompts], pad_id)
    groups = []
    for g in range(o["groups_per_step"]):
        grp = []
        for k in range(o["group_size"]):
            i = g * o["group_size"] + k
            p, n = len(prompts[i]), len(answers[i])
            s = Sample(seqs[i], [0] * p + [1] * n, behav[i], [-1] * p + [step] * n)
            grp.append(TrajectoryCompleted(f"s{step}-{i}", f"g{step}-{g}", train_rewards[i], [s]))
        groups.append(grp)
    return groups, rewards, answers


def trainer_config(o: dict) -> TrainerConfig:
    """The TrainerConfig of a run's options (its engine and LoRA knobs), validated as the trainer does."""
    return TrainerConfig(model_dir=o["model"], lr=o["lr"], lr_warmup_steps=o["lr_warmup_steps"], beta1=o["beta1"],
                         beta2=o["beta2"], adam_eps=o["adam_eps"], weight_decay=o["weight_decay"],
                         grad_clip=o["grad_clip"], ppo_epochs=o["ppo_epochs"], lora_rank=o["lora_rank"],
                         lora_alpha=o["lora_alpha"], lora_targets=o["lora_targets"])


def build_policy(o: dict):
    """(policy, optimizer, lr scheduler, KL reference) as TrainEngine builds them at world size 1:
    with lora_rank > 0 the model is lora.wrap'ed (base frozen, the adapter alone trained) and the
    reference is the policy itself, run under `lora.adapter_disabled` (`reference` below); without
    LoRA a second frozen copy when kl_coef != 0. The optimizer is optim.adamw over the trainable
    parameters, the lr warm-up the engine's LambdaLR."""
    from transformers import AutoModelForCausalLM

    cfg = trainer_config(o)
    model = AutoModelForCausalLM.from_pretrained(o["model"], dtype=torch.float32)
    spec = lora.lora_spec(cfg)
    if spec is not None:
        model = lora.wrap(model, spec, cfg.model_dir)
    ref = None
    if o["kl_coef"]:
        ref = model if spec is not None else \
            AutoModelForCausalLM.from_pretrained(o["model"], dtype=torch.float32).eval().requires_grad_(False)
    opt, _sit_out = optim.adamw(cfg, {"": [p for p in model.parameters() if p.requires_grad]})
    warmup = max(cfg.lr_warmup_steps, 0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
    return model, opt, sched, ref


@contextlib.contextmanager
def reference(model, ref):
    """The module that computes the KL reference: `ref` itself, or, when it is the (LoRA) policy,
    the policy with its adapter off, as engine._ref_pass does."""
    if ref is model:
        with lora.adapter_disabled(model):
            yield model
    else:
        yield ref


class Behaviour:
    """The policy rollout samples from: the live model, or with `staleness` K > 0 a copy holding the
    weights after step max(0, t - K), kept as CPU copies (full fine-tune only)."""

    def __init__(self, model, staleness: int):
        import copy

        if staleness and hasattr(model, "peft_config"):
            raise ValueError("staleness emulation needs a full fine-tune (lora_rank 0)")
        self.live, self.staleness, self.version = model, staleness, 0
        self.model = copy.deepcopy(model).eval().requires_grad_(False) if staleness else model
        self.states = {0: self._copy(model)} if staleness else {}

    @staticmethod
    def _copy(model) -> dict:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def stepped(self, version: int) -> None:
        """The live model has now taken `version` steps; versions no later step samples from are dropped."""
        if self.staleness:
            self.states[version] = self._copy(self.live)
            for v in [v for v in self.states if v < version - self.staleness]:
                del self.states[v]

    def policy(self, step: int):
        """The model that samples step `step`'s batch (its version is then `self.version`)."""
        version = max(0, step - self.staleness)
        if self.staleness and (version != self.version or step == 0):
            self.model.load_state_dict(self.states[version])
        self.version = version
        return self.model


def train_step(model, optim: tuple, gb, algo: AlgoConfig, o: dict, pad_id: int,  # noqa: PLR0913  the engine's inputs
               ref=None) -> tuple[list[dict], torch.Tensor]:
    """TrainEngine.train_step at world size 1, without DeepSpeed: (each micro-batch's metrics, the grad norm).
    `optim`: (optimizer, lr scheduler)."""
    opt, sched = optim
    batches = micro_batches(gb.rows, o["micro_batch_tokens"], pad_id)
    norm_tokens = float(sum(mb.num_tokens for mb in batches))
    norm_seqs = float(sum(mb.num_seqs for mb in batches))
    model.train()
    prox = [None] * len(batches)
    parts = []
    for _epoch in range(o["ppo_epochs"]):
        opt.zero_grad(set_to_none=True)
        for i, mb in enumerate(batches):
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
            logp, entropy = token_logprobs(logits, mb.targets, True)
            if prox[i] is None:
                prox[i] = logp.detach()
            if algo.entropy_coef == 0.0:
                entropy = entropy.detach()
            ref_logp = None
            if ref is not None:
                with torch.no_grad(), reference(model, ref) as base:
                    ref_logp = token_logprobs(base(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits,
                                              mb.targets, False)[0]
            loss, m = policy_loss(logp, prox[i], mb.behav_logprobs, mb.advantages, mb.loss_mask, algo,
                                  ref_logp=ref_logp, entropy=entropy, num_tokens=norm_tokens, num_seqs=norm_seqs)
            loss.backward()
            parts.append(m)
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), o["grad_clip"] if o["grad_clip"] > 0 else 1e30)
        opt.step()
        sched.step()
    return parts, gn


def run(opts: dict) -> dict:
    from transformers import AutoTokenizer

    o = {**DEFAULTS, **opts}
    algo = AlgoConfig(advantage=o["advantage"], std_normalize=o["std_normalize"],
                      group_baseline=o["group_baseline"], clip_low=o["clip_low"], clip_high=o["clip_high"],
                      decoupled=o["decoupled"], tis=o["tis"], tis_cap=o["tis_cap"],
                      entropy_coef=o["entropy_coef"], aggregation=o["aggregation"],
                      drop_uniform_groups=o["drop_uniform_groups"], kl_coef=o["kl_coef"])
    torch.manual_seed(o["seed"])
    rng = random.Random(o["task_seed"] * 1000 + o["seed"])
    tok = AutoTokenizer.from_pretrained(o["model"])
    model, opt, sched, ref = build_policy(o)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    evaluate = Evaluator(tok, o["eval_n"])
    log = (lambda *a: None) if o["quiet"] else (lambda *a: print(*a, flush=True))
    evals, batch_rewards, batch_exact, step_metrics = {}, [], [], []
    t_steps = 0.0
    behaviour = Behaviour(model, o["staleness"])
    for step in range(o["steps"] + 1):
        if o["eval_every"] and step % o["eval_every"] == 0:
            evals[step] = evaluate(model)
            log(f"[eval] step {step:3d} sampled {evals[step]['sampled']:.3f} greedy {evals[step]['greedy']:.3f} "
                f"eos {evals[step]['eos_frac']:.2f} len {evals[step]['len']:.2f}")
        if step == o["steps"]:
            break
        t0 = time.perf_counter()
        # 1. rollout: G prompts x group_size samples from the current policy (with staleness: an older one)
        groups, rewards, answers = rollout(behaviour.policy(step), tok, rng, o, behaviour.version, pad_id)
        # 2. the trainer's step (TrainEngine.train_step, world size 1, no DeepSpeed)
        gb = build_global_batch(groups, algo)
        parts, gn = train_step(model, (opt, sched), gb, algo, o, pad_id, ref)
        dt = time.perf_counter() - t0
        t_steps += dt
        m = merge_metrics(parts)
        m.update(gb.metrics, grad_norm=float(gn), lr=opt.param_groups[0]["lr"])
        step_metrics.append({k: round(v, 4) for k, v in m.items()})
        batch_rewards.append(sum(rewards) / len(rewards))
        batch_exact.append(sum(r == 1.0 for r in rewards) / len(rewards))
        eos = sum(tok.eos_token_id in a for a in answers) / len(answers)
        log(f"step {step:3d} reward {batch_rewards[-1]:.3f} adv_std {m['adv_std']:.2f} "
            f"ent {m.get('entropy', 0):.3f} clip {m['clip_frac']:.3f} gnorm {float(gn):.2f} eos {eos:.2f} {dt:.2f}s")
        behaviour.stepped(step + 1)
    if o["save"]:  # a LoRA run saves base + adapter merged: a plain HF model, a warm start like any other
        (model.merge_and_unload() if o["lora_rank"] else model).save_pretrained(o["save"], safe_serialization=True)
        tok.save_pretrained(o["save"])
    res = {
        "name": o["name"], "opts": {k: v for k, v in o.items() if k in opts},
        "eval": {str(k): {kk: round(vv, 4) for kk, vv in v.items()} for k, v in evals.items()},
        "batch_reward": [round(r, 3) for r in batch_rewards],
        "batch_exact": [round(r, 3) for r in batch_exact],
        # the demo's figure: in-loop mean reward, first 8 steps -> last 8 steps, and the lowest
        # 8-step rolling mean below the first 8 (the "dip")
        "loop_gain": round(_mean(batch_rewards[-8:]) - _mean(batch_rewards[:8]), 3),
        "loop_dip": round(_mean(batch_rewards[:8]) - min(_mean(batch_rewards[max(0, i - 7):i + 1])
                                                         for i in range(7, len(batch_rewards))), 3)
        if len(batch_rewards) >= 8 else 0.0,
        "groups_dropped": sum(m.get("groups_dropped", 0) for m in step_metrics),
        "sec_per_step": round(t_steps / max(o["steps"], 1), 3),
        "trainable_params": trainable,
        "final_entropy": step_metrics[-1].get("entropy") if step_metrics else None,
        "entropy": [m.get("entropy") for m in step_metrics],
        "grad_norm": [m["grad_norm"] for m in step_metrics],
    }
    return res


def prepare(dirpath: Path, targets: list[float], warm_steps: list[int]) -> None:
    """The tiny model as tests/conftest.py builds it, then warm starts with warmstart.warm_start."""
    import shutil

    from seamlessflow.modelgen import init_model
    from seamlessflow.demo.warmstart import WarmStart, warm_start

    tiny = dirpath / "tiny"
    if not (tiny / "config.json").exists():
        init_model(tiny, size="tiny")
    for t in targets:
        out = dirpath / f"warm{t}"
        if not (out / "config.json").exists():
            print(f"target {t}:", warm_start(tiny, out, WarmStart(target_reward=t)), flush=True)
    for n in warm_steps:  # fixed step counts (warm_start checks its target every 25 steps only)
        out = dirpath / f"warmsteps{n}"
        if not (out / "config.json").exists():
            print(f"steps {n}:", warm_start(tiny, out, WarmStart(target_reward=9.0, max_steps=n)), flush=True)
            for extra in ("generation_config.json",):
                if (tiny / extra).exists() and not (out / extra).exists():
                    shutil.copy(tiny / extra, out / extra)


def _mean(xs) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _bool(s: str) -> bool:
    return s.lower() in ("1", "true", "yes", "y")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--dir", default="/tmp/probe")
    p.add_argument("--targets", type=float, nargs="*", default=[0.3])
    p.add_argument("--warm-steps", type=int, nargs="*", default=[])
    r = sub.add_parser("run")
    for k, v in DEFAULTS.items():
        typ = _bool if isinstance(v, bool) else type(v)
        r.add_argument("--" + k.replace("_", "-"), type=typ, default=v)
    s = sub.add_parser("sweep")
    s.add_argument("grid", help="JSON file: a list of option dicts")
    s.add_argument("--out", default="-")
    a = ap.parse_args(argv)
    if a.cmd == "prepare":
        prepare(Path(a.dir), a.targets, a.warm_steps)
    elif a.cmd == "run":
        opts = {k: getattr(a, k) for k in DEFAULTS if getattr(a, k) != DEFAULTS[k]}
        print(json.dumps(run(opts)))
    else:
        grid = json.loads(Path(a.grid).read_text())
        out = sys.stdout if a.out == "-" else open(a.out, "a")  # noqa: SIM115
        for opts in grid:
            t0 = time.perf_counter()
            res = run({"quiet": True, **opts})
            res["wall_s"] = round(time.perf_counter() - t0, 1)
            ev = res["eval"]
            print(f"# {res['name'] or opts}: gain {res['loop_gain']:+.3f} dip {res['loop_dip']:.3f} " + " ".join(f"{k}:{v['sampled']:.3f}/{v['greedy']:.3f}"
                                                         for k, v in ev.items()), file=sys.stderr, flush=True)
            out.write(json.dumps(res) + "\n")
            out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
