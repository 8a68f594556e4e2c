"""Multi-LoRA across ranks: whether a role sits a step out is decided over every rank's samples.

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m tests.integration.multilora_ranks \\
        --model M --out OUT --stages 0,2

For each ZeRO stage, two roles (planner, solver) and three steps of services/trainer/dp_check.py's
synthetic groups, each rank on its own token-balanced shard:
1. both roles' samples on every rank;
2. the solver's samples on rank 0 only (rank 1 keeps its planner rows): the solver has samples in
   this step, so every rank must step its group (ZeRO 1-2: each rank its own partition of it);
3. the planner's samples alone, on every rank: the solver sits the step out everywhere.
Rank r writes OUT/rank<r>.json: per stage, how far each adapter tensor moved in each step (the
least and the most), and a digest of the parameters. The test reads it and asserts.
It drives the engine only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

from services.trainer.batching import build_global_batch, role_micro_batches, shard_rows
from services.trainer.config import TrainerConfig
from services.trainer.dp_check import synthetic_groups
from services.trainer.engine import TrainEngine

ROLES = ("planner", "solver")


def with_roles(groups):
    return [[msgspec.structs.replace(t, metadata={**t.metadata, "role": ROLES[i % 2]}) for i, t in enumerate(g)]
            for g in groups]


def adapters(eng: TrainEngine) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {r: {} for r in ROLES}
    for name, t in eng.full_state_dict().items():
        for role in ROLES:
            if f".{role}." in name:
                out[role][name] = t
    return out


def movement(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """The least and the most any one tensor moved (max abs difference per tensor)."""
    per = [float((a[k] - b[k]).abs().max()) for k in a]
    return {"least": min(per), "most": max(per)}


def run(cfg: TrainerConfig) -> dict:
    eng = TrainEngine(cfg)
    vocab = eng.module.config.vocab_size
    report: dict = {"steps": []}
    keep = [lambda r: True, lambda r: r.role == "planner" or eng.rank == 0, lambda r: r.role == "planner"]
    for step, wanted in enumerate(keep):
        before = adapters(eng)
        gb = build_global_batch(with_roles(synthetic_groups(step, vocab=vocab)), eng.algo)
        rows = [r for r in shard_rows(gb.rows, eng.rank, eng.world) if wanted(r)]
        eng.train_step(role_micro_batches(rows, cfg.micro_batch_tokens, eng.pad_id, eng.roles))
        after = adapters(eng)
        report["steps"].append({
            "local_roles": sorted({r.role for r in rows}),
            **{role: movement(before[role], after[role]) for role in ROLES},
        })
    flat = torch.cat([v.flatten().double() for _, v in sorted(eng.full_state_dict().items())])
    report["digest"] = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--stages", default="0,2")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {}
    for stage in [int(s) for s in args.stages.split(",")]:
        cfg = TrainerConfig(model_dir=args.model, zero_stage=stage, lr=1e-2, weight_decay=0.1, grad_clip=1.0,
                            micro_batch_tokens=32, lora_rank=4, lora_alpha=8.0, kl_coef=0.0,
                            lora_roles=",".join(ROLES))
        report[f"zero{stage}"] = run(cfg)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
