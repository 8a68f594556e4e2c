"""SIMULATED trainer, for benchmarks only: the real TrainerService and Runner around an engine
that trains nothing and sleeps a calibrated time per token.

    SF_TRAINER_SCHEDULER_GATE=true .venv/bin/python bench/sim_trainer.py --model DIR \\
        --checkpoint-dir DIR --weights-dir DIR [--s-per-token 5.84e-5] [--log steps.jsonl]

Real: the NATS consumer and its acks, intake and ledger, the scheduler's gate, TrainerStatus
heartbeats, offload/reload control, weight publishing (a version directory in the weight
store, announced on sf.weights.published, garbage-collected) and the audit log. Replaced:
`TrainEngine`. `train_step` sleeps `s_per_token` x every non-pad token of the batch (prompt
and generated, as services/scheduler/sim/simulator.py charges a trained token); `save_hf` hard-links
the starting checkpoint's files into the version directory (the weights never change);
checkpoints are a JSON file of the client state (written to a temp file, then renamed), and a
restart resumes from it as the real trainer resumes from its DeepSpeed checkpoint: the fault
suite (tests/faults) kills this trainer and checks that every trajectory trains exactly once.
Each step appends {step, ts, compute_s, tokens_all, tokens_loss, samples} to --log, so a
benchmark can read the trained tokens.

Default cost: the tiny model's measured DeepSpeed ZeRO-0 step, 17,123 tok/s (BENCHMARKS.md),
the cost CALIBRATIONS["live-mini"] uses.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.trainer.batching import MicroBatch  # noqa: E402
from services.trainer.config import TrainerConfig, load_config  # noqa: E402
from shared.config import ConfigError, connections  # noqa: E402
from shared.lifecycle import run_until_signalled  # noqa: E402

S_PER_TOKEN = 1 / 17_123

log = logging.getLogger("sim_trainer")


class SleepEngine:
    """The part of TrainEngine the Runner uses, with a sleep per token for the step."""

    def __init__(self, cfg: TrainerConfig, s_per_token: float, step_log: Path | None):
        self.cfg, self.algo = cfg, cfg.algo()
        self.rank, self.world = 0, 1
        self.pad_id = 0
        self.offloaded = False
        self.s_per_token = s_per_token
        self.step_log = step_log
        self.steps = 0

    def train_step(self, batches: list[MicroBatch]) -> dict[str, float]:
        t0 = time.perf_counter()
        tokens = sum(int(mb.attention_mask.sum()) for mb in batches)
        loss_tokens = sum(mb.num_tokens for mb in batches)
        samples = sum(mb.num_seqs for mb in batches)
        time.sleep(tokens * self.s_per_token)
        self.steps += 1
        compute_s = time.perf_counter() - t0
        if self.step_log is not None:
            with self.step_log.open("a") as f:
                f.write(json.dumps({"step": self.steps, "ts": time.time(), "compute_s": compute_s,
                                    "tokens_all": tokens, "tokens_loss": loss_tokens, "samples": samples}) + "\n")
        return {"loss": 0.0, "tokens": float(loss_tokens), "micro_batches": float(len(batches)),
                "compute_s": compute_s}

    def save_hf(self, out_dir: str | Path) -> Path:
        out, tmp = Path(out_dir), Path(str(out_dir) + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        for f in Path(self.cfg.model_dir).iterdir():
            if f.is_file():
                os.link(f, tmp / f.name)
        tmp.rename(out)
        return out

    def save_checkpoint(self, root: str | Path, client_state: dict) -> str:
        tag = f"step-{self.steps:08d}"
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / "client_state.json.tmp"  # a kill mid-write leaves the previous checkpoint whole
        tmp.write_text(json.dumps({"steps": self.steps, "client_state": client_state}))
        os.replace(tmp, root / "client_state.json")
        return tag

    def load_checkpoint(self, root: str | Path) -> dict | None:
        """The client state of the last checkpoint under `root` (None: start fresh)."""
        path = Path(root) / "client_state.json"
        if not path.exists():
            return None
        saved = json.loads(path.read_text())
        self.steps = int(saved["steps"])
        return saved["client_state"]

    def offload(self) -> dict[str, float]:
        self.offloaded = True
        return {"offload_s": 0.0}

    def reload(self) -> dict[str, float]:
        self.offloaded = False
        return {"reload_s": 0.0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--checkpoint-dir", required=True)
    ap.add_argument("--weights-dir", required=True)
    ap.add_argument("--s-per-token", type=float, default=S_PER_TOKEN)
    ap.add_argument("--log", type=Path, help="append one JSON line per step here")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = load_config(model_dir=a.model, checkpoint_dir=a.checkpoint_dir, weights_dir=a.weights_dir)
        conn = connections()
    except ConfigError as e:
        ap.error(str(e))
    from transformers import AutoConfig

    from services.trainer.runner import Runner
    from services.trainer.service import TrainerService

    log.warning("SIMULATED trainer (no model trains): %.3g s per token", a.s_per_token)
    engine = SleepEngine(cfg, a.s_per_token, a.log)
    resume = engine.load_checkpoint(cfg.checkpoint_dir)
    if resume is not None:
        log.info("resumed from %s at step %s (version %s)", cfg.checkpoint_dir, resume.get("step"), resume.get("version"))
    runner = Runner(engine, cfg.checkpoint_dir)  # type: ignore[arg-type]
    vocab = AutoConfig.from_pretrained(cfg.model_dir).vocab_size

    return run_until_signalled(TrainerService(cfg, conn, runner, resume, vocab).run)


if __name__ == "__main__":
    sys.exit(main())
