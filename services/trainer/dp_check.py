"""Data-parallel self-check: ranks train on disjoint shards of the same batches and must end identical.

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m services.trainer.dp_check \\
        --model var/model --out /tmp/dp --stages 0,2 --steps 3

For each ZeRO stage, every rank builds the same synthetic global batches
(GRPO groups with varied lengths, behaviour logprobs and versions), takes its
token-balanced shard - so ranks see different data and usually different
micro-batch counts - and runs `TrainEngine.train_step`. Rank r writes
OUT/rank<r>-zero<s>.pt (full parameters) and OUT/rank<r>.json (micro-batch counts
and global loss per step). Exit status 1 when the ranks' parameters differ.

`train()` with one rank trains on the whole batches: the result should equal the
multi-rank one to fp32 round-off, which checks the global loss normalisation.
It owns no production logic; it only drives the engine the way the service will.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from services.trainer.batching import Group, build_global_batch, micro_batches, shard_rows
from services.trainer.config import TrainerConfig
from services.trainer.engine import TrainEngine
from shared.messages.trajectory import Sample, TrajectoryCompleted


def synthetic_groups(step: int, n_groups: int = 3, group_size: int = 4, vocab: int = 512,
                     seed: int = 0) -> list[Group]:
    """Deterministic GRPO groups for `step`; one long sample per step makes shards uneven in count."""
    rng = random.Random(seed * 100_003 + step)
    groups = []
    for g in range(n_groups):
        members = []
        for i in range(group_size):
            prompt = rng.randint(2, 6)
            completion = 24 if (g, i) == (0, 0) else rng.randint(1, 6)
            tokens = [rng.randrange(3, vocab) for _ in range(prompt + completion)]
            version = rng.choice([step, step - 1, step - 2])
            sample = Sample(
                token_ids=tokens,
                loss_mask=[0] * prompt + [1] * completion,
                logprobs=[0.0] * prompt + [-6.24 + rng.uniform(-0.3, 0.3) for _ in range(completion)],
                versions=[-1] * prompt + [version] * completion,
            )
            members.append(TrajectoryCompleted(session_id=f"s{step}-{g}-{i}", group_id=f"g{step}-{g}",
                                               reward=rng.random(), samples=[sample]))
        groups.append(members)
    return groups


def train(cfg: TrainerConfig, steps: int) -> tuple[dict[str, torch.Tensor], dict[str, list], TrainEngine]:
    """Train `steps` synthetic global batches.

    Returns (full params on CPU, {"micro_batches": local counts, "loss"/"grad_norm": global
    per-step metrics}, the engine).
    """
    engine = TrainEngine(cfg)
    log: dict[str, list] = {"micro_batches": [], "loss": [], "grad_norm": []}
    for step in range(steps):
        gb = build_global_batch(synthetic_groups(step, vocab=engine.module.config.vocab_size), engine.algo)
        rows = shard_rows(gb.rows, engine.rank, engine.world)
        batches = micro_batches(rows, cfg.micro_batch_tokens, engine.pad_id)
        metrics = engine.train_step(batches)
        log["micro_batches"].append(len(batches))
        log["loss"].append(metrics["loss"])
        log["grad_norm"].append(metrics.get("grad_norm"))
    return engine.full_state_dict(), log, engine


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--stages", default="0,2")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--micro-batch-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ok, report = True, {}
    for stage in [int(s) for s in args.stages.split(",")]:
        cfg = TrainerConfig(model_dir=args.model, zero_stage=stage, lr=1e-3, grad_clip=1.0,
                            micro_batch_tokens=args.micro_batch_tokens)
        state, log, engine = train(cfg, args.steps)
        rank, world = engine.rank, engine.world
        torch.save(state, out / f"rank{rank}-zero{stage}.pt")
        report[f"zero{stage}"] = log
        # Compare with rank 0 bit for bit: DeepSpeed must leave every rank with the same weights.
        flat = torch.cat([v.flatten().double() for _, v in sorted(state.items())])
        gathered = [torch.zeros_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        same = all(torch.equal(gathered[0], g) for g in gathered)
        ok &= same
        print(f"rank {rank} zero {stage}: micro-batches {log['micro_batches']}, identical across ranks: {same}", flush=True)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
