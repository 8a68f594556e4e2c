"""What DeepSpeed costs the trainer: trained tokens/s of TrainEngine vs a plain-PyTorch loop.

    OMP_NUM_THREADS=2 DS_ACCELERATOR=cpu .venv/bin/python bench/train_step.py   # 1.5-5 min on 2 shared CPU cores

Two models written by `seamlessflow.modelgen.init_model`: tiny (hidden 128, 2 layers) and
medium (hidden 512, 8 layers; its parameter count is printed). For each model, three paths
in the same process, side by side, one step each per round with the order rotated every
round so that machine drift hits all of them alike:
  plain  AutoModelForCausalLM + torch.optim.AdamW, loss from algorithms.policy_loss,
         gradient accumulation over the micro-batches, clip_grad_norm_, one optimizer step;
  zero0  services.trainer.engine.TrainEngine, ZeRO stage 0;
  zero2  TrainEngine, ZeRO stage 2;
  zero0-lora  TrainEngine, ZeRO stage 0, LoRA of rank --lora-rank on every projection
         (only with --lora-rank > 0; its loss differs from plain's by design).
Each row also gives the trained parameters and the optimizer state held per rank (Adam's
moments, MB): LoRA against full.
All paths load the same HF weights, use lr 1e-4, grad clip 1.0, fp32, and train on the same
micro-batches (built once: synthetic TrajectoryCompleted groups -> build_global_batch ->
micro_batches). The plain loop does the same work as TrainEngine.train_step besides
DeepSpeed (the detached entropy metric, per-micro-batch metrics), so the difference is
DeepSpeed's. Each path gets `--warmup` untimed steps, then `--steps` timed ones (tiny) or
`--medium-steps` (others: the medium model takes 4-15 s a step on 2 shared cores, so 3 by default).
tokens/s = trained (loss-mask) tokens per step / median step time (the machine is shared: the
median shrugs off a step that another process stalled; mean and min are printed too).
Overhead = plain tokens/s over the path's tokens/s, minus 1. Goal (the issue): under 15% at ZeRO 0.

As a sanity check the per-step losses of the DeepSpeed paths are compared with the plain
loop's (same init, same data, same optimizer: they should agree closely).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "tests" / "torch_extensions"))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from seamlessflow.modelgen import init_model  # noqa: E402
from services.trainer.algorithms import merge_metrics, policy_loss  # noqa: E402
from services.trainer.batching import build_global_batch, micro_batches  # noqa: E402
from services.trainer.config import TrainerConfig  # noqa: E402
from services.trainer.engine import TrainEngine, token_logprobs  # noqa: E402
from shared.messages.trajectory import Sample, TrajectoryCompleted  # noqa: E402

LR = 1e-4


def make_groups(n_groups: int, group_size: int, prompt: int, generated: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    groups = []
    for gi in range(n_groups):
        group = []
        for si in range(group_size):
            n = prompt + generated
            ids = torch.randint(8, vocab, (n,), generator=g).tolist()  # clear of the special tokens
            sample = Sample(token_ids=ids, loss_mask=[0] * prompt + [1] * generated,
                            logprobs=[0.0] * prompt + [-2.0] * generated,
                            versions=[-1] * prompt + [0] * generated)
            reward = float(torch.rand((), generator=g))
            group.append(TrajectoryCompleted(session_id=f"s{gi}-{si}", group_id=f"g{gi}", reward=reward,
                                             samples=[sample]))
        groups.append(group)
    return groups


class PlainTrainer:
    """The reference: what TrainEngine.train_step does at world size 1, without DeepSpeed."""

    def __init__(self, cfg: TrainerConfig):
        self.cfg, self.algo = cfg, cfg.algo()
        torch.manual_seed(cfg.seed)
        self.model = AutoModelForCausalLM.from_pretrained(cfg.model_dir, dtype=torch.float32)
        self.model.config.use_cache = False
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                     eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
        self.track_entropy = self.model.config.vocab_size <= 65536  # as TrainEngine._track_entropy

    def train_step(self, batches) -> dict[str, float]:
        norm_tokens = float(sum(mb.num_tokens for mb in batches))
        norm_seqs = float(sum(mb.num_seqs for mb in batches))
        with_entropy = self.cfg.entropy_coef != 0.0 or self.track_entropy
        self.model.train()
        parts, loss_sum = [], 0.0
        for mb in batches:
            logits = self.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
            logp, entropy = token_logprobs(logits, mb.targets, with_entropy)
            if entropy is not None and self.algo.entropy_coef == 0.0:
                entropy = entropy.detach()
            loss, m = policy_loss(logp, logp.detach(), mb.behav_logprobs, mb.advantages, mb.loss_mask, self.algo,
                                  entropy=entropy, num_tokens=norm_tokens, num_seqs=norm_seqs)
            loss.backward()
            parts.append(m)
            loss_sum += float(loss.detach())
        grad_norm = None
        if self.cfg.grad_clip > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        metrics = merge_metrics(parts)
        metrics["loss"] = loss_sum
        if grad_norm is not None:
            metrics["grad_norm"] = grad_norm
        return metrics


def state_size(path) -> dict:
    """Trained parameters and the optimizer state this rank holds (all of it at ZeRO 0)."""
    module = path.model if hasattr(path, "model") else path.module
    opt = path.opt if hasattr(path, "opt") else path.engine.optimizer
    inner = getattr(opt, "optimizer", opt)  # a ZeRO optimizer wraps the client one
    state = sum(t.numel() * t.element_size() for st in inner.state.values() for t in st.values()
                if torch.is_tensor(t) and t.dim() > 0)
    return {"trained_params": sum(p.numel() for p in module.parameters() if p.requires_grad),
            "optimizer_mb": state / 1e6}


def bench_model(spec: str, work: Path, args) -> list[dict]:
    size, _, given = spec.partition("=")  # NAME=DIR: a checkpoint already built (the tiny one, say)
    model_dir = Path(given).resolve() if given else init_model(work / size, size=size)
    cfgs = {
        "plain": TrainerConfig(model_dir=str(model_dir), zero_stage=0, lr=LR),
        "zero0": TrainerConfig(model_dir=str(model_dir), zero_stage=0, lr=LR),
        "zero2": TrainerConfig(model_dir=str(model_dir), zero_stage=2, lr=LR),
    }
    if args.lora_rank:
        cfgs["zero0-lora"] = TrainerConfig(model_dir=str(model_dir), zero_stage=0, lr=LR, lora_rank=args.lora_rank)
    paths = {"plain": PlainTrainer(cfgs["plain"])}
    for name in cfgs:
        if name != "plain":
            paths[name] = TrainEngine(cfgs[name])
    model = paths["plain"].model
    params = sum(p.numel() for p in model.parameters())
    vocab = model.config.vocab_size
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    groups = make_groups(args.groups, args.group_size, args.prompt, args.generated, vocab)
    gb = build_global_batch(groups, cfgs["plain"].algo())
    batches = micro_batches(gb.rows, args.micro_batch_tokens, pad)
    tokens = sum(mb.num_tokens for mb in batches)
    steps = args.steps if size == "tiny" else args.medium_steps
    names = list(paths)
    times = {n: [] for n in names}
    losses = {n: [] for n in names}
    total = args.warmup + steps
    for r in range(total):
        order = names[r % len(names):] + names[: r % len(names)]  # rotate who goes first
        for n in order:
            t0 = time.perf_counter()
            m = paths[n].train_step(batches)
            dt = time.perf_counter() - t0
            losses[n].append(m["loss"])
            if r >= args.warmup:
                times[n].append(dt)
        print(f"[{size}] round {r + 1}/{total}" + ("" if r >= args.warmup else " (warm-up)") + ": "
              + ", ".join(f"{n} {times[n][-1]:.3f}s" if r >= args.warmup else n for n in names),
              file=sys.stderr, flush=True)
    rows = []
    plain_tps = tokens / statistics.median(times["plain"])
    for n in names:
        tps = tokens / statistics.median(times[n])
        rows.append({
            "model": size, "params": params, "path": n, "tokens_per_step": tokens,
            "micro_batches": len(batches), "steps": steps,
            "step_s_median": statistics.median(times[n]), "step_s_mean": sum(times[n]) / steps,
            "step_s_min": min(times[n]),
            "tokens_per_s": tps, "overhead_pct": (plain_tps / tps - 1.0) * 100.0,
            "max_loss_diff_vs_plain": max(abs(a - b) for a, b in zip(losses[n], losses["plain"])),
            **state_size(paths[n]),
        })
    del paths
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,medium", help="comma-separated init_model sizes; NAME=DIR "
                    "trains the checkpoint in DIR under that name (e.g. tiny=var/model: not built again)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per path, tiny model")
    ap.add_argument("--medium-steps", type=int, default=3, help="timed steps per path, other models")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--generated", type=int, default=96)
    ap.add_argument("--micro-batch-tokens", type=int, default=1024,
                    help="padded positions per micro-batch (1024: 4 micro-batches of 8 x 127)")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--lora-rank", type=int, default=0, help="also a ZeRO-0 LoRA path of this rank (0 = none)")
    args = ap.parse_args()

    rows = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sf-bench-train-") as tmp:
        for size in args.models.split(","):
            rows += bench_model(size.strip(), Path(tmp), args)
    first = rows[0]
    print(f"\n{args.groups} groups x {args.group_size} samples x {args.prompt + args.generated} tokens "
          f"({args.prompt} prompt, {args.generated} generated): {first['tokens_per_step']} trained tokens "
          f"per step in {first['micro_batches']} micro-batches; warm-up {args.warmup}, timed steps "
          f"{args.steps} (tiny) / {args.medium_steps} (others); torch threads {torch.get_num_threads()}; "
          f"total {time.perf_counter() - t0:.0f} s\n")
    print("| model | params | path | step s (median / mean / min) | tokens/s | overhead vs plain | max loss diff vs plain "
          "| trained params | optimizer state MB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        over = "-" if r["path"] == "plain" else f"{r['overhead_pct']:+.1f}%"
        diff = "-" if r["path"] == "plain" else f"{r['max_loss_diff_vs_plain']:.2e}"
        print(f"| {r['model']} | {r['params'] / 1e6:.2f}M | {r['path']} | {r['step_s_median']:.3f} / {r['step_s_mean']:.3f} / "
              f"{r['step_s_min']:.3f} | {r['tokens_per_s']:.0f} | {over} | {diff} | {r['trained_params']:,} | "
              f"{r['optimizer_mb']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
