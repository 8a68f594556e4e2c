"""The trainer's end of a network round on real DeepSpeed: 2 gloo ranks under ZeRO-3 (every
parameter partitioned), rank 0 sends through its Runner's `send` command while rank 1 joins each
layer group's gather; a receiver gets exactly the model's full parameters, in bf16 on the wire
too. No rank ever holds more than one gathered group (engine.send_weights)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.deepspeed,
              pytest.mark.filterwarnings("ignore:.*is deprecated.*:FutureWarning")]

ROOT = Path(__file__).resolve().parents[2]

# Each rank tears its process group down before it exits, as services/trainer/__main__.py does. Rank 1
# still aborted at interpreter exit in 2 of 4 suite runs on 2026-12-06, after its work was done
# ("terminate called without an active exception": a native thread still joinable at finalization;
# 0 of 4 by hand), so it leaves with os._exit: what this test checks ends at `stop`. Whether the
# trainer's own ranks > 0 can abort the same way at exit is open (the session 19 note).
SCRIPT = r'''
import os, sys, threading, torch
import torch.distributed as dist
from services.trainer.config import TrainerConfig
from services.trainer.engine import TrainEngine
from services.trainer.runner import Command, Runner
from shared.weightxfer import WeightSender, join, receive
from transformers import AutoModelForCausalLM

model_dir, wire = sys.argv[1], sys.argv[2]
cfg = TrainerConfig(model_dir=model_dir, zero_stage=3, dtype="fp32", weights_transport="network",
                    weights_bucket_mb=1, weights_wire_dtype=wire, metrics_port=0, tensorboard_dir="", audit_log="")
engine = TrainEngine(cfg)
if engine.rank != 0:
    Runner(engine, "/tmp/unused").follow()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
sender = WeightSender("127.0.0.1", 0, timeout=60)
runner = Runner(engine, "/tmp/unused", sender)
got = {}
rx = threading.Thread(target=lambda: receive(join("127.0.0.1", sender.port, "g1"),
                                             lambda ts: got.update({n: t.clone() for n, t in ts})))
rx.start()
out = runner.run(Command("send", version=1, group="g1", receivers=1))
rx.join(60)
runner.run(Command("stop"))
dist.destroy_process_group()
ref = dict(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters())
dtype = getattr(torch, wire) if wire else torch.float32
assert out["receivers"] == 1 and out["sent_bytes"] > 0, out
assert sorted(got) == sorted(ref), (sorted(got)[:3], sorted(ref)[:3])
bad = [n for n in ref if got[n].dtype != dtype or not torch.equal(got[n], ref[n].detach().to(dtype))]
assert not bad, bad[:5]
print("OK", len(got), out["sent_bytes"])
'''


@pytest.mark.parametrize("wire", ["", "bfloat16"], ids=["fp32", "bf16"])
def test_zero3_ranks_stream_the_full_parameters_group_by_group(tiny_model, tmp_path, wire):
    script = tmp_path / "send.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
           str(tiny_model), wire]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]
