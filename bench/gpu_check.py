"""The GPU check, for when a CUDA machine is lent: one script, under 10 minutes, three stages.

    .venv/bin/python bench/gpu_check.py --out /tmp/gpu_check            # all stages
    .venv/bin/python bench/gpu_check.py --only sleep                    # one stage

Stages (each in a process of its own, so each starts with the whole device, and each bounded):
1. `deepspeed` - our TrainEngine (services/trainer/engine.py) on a ~1B Llama at ZeRO-2, bf16: one
   step, then `offload` / `reload` (DeepSpeed offload_states / reload_states), with the device
   memory allocated before, offloaded and after. The lending path's trainer half.
2. `sleep` - a vLLM engine on the same model with sleep mode: start, sleep level 1 and wake_up,
   sleep level 2 and the staged wake `wake_up(["weights"])` + `wake_up(["kv_cache"])`, with the
   device memory each leaves in use. The lending path's rollout half (services/rollout/engine.py).
3. `nccl` - vLLM's own RL weight transfer (`weight_transfer_config` backend "nccl",
   NCCLTrainerWeightTransferEngine): the trainer's copy of the model on cuda:1 broadcast into the
   engine on cuda:0; seconds and GB/s. Needs 2 GPUs: NCCL refuses two ranks on one device (a
   one-GPU host shares weights with the `ipc` backend instead); on one GPU it is reported skipped.

The ~1B model is built here (random weights, no download: hidden 2048, 16 layers, vocab 32000,
~1.1B parameters). Prints one JSON line per stage and a markdown table; `--out` keeps them as
results.json. Without CUDA it refuses at once with exit 2 and says why; nothing here runs on CPU.
Results go to BENCHMARKS.md by hand once it has run on a lent GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("deepspeed", "sleep", "nccl")
STAGE_TIMEOUT = {"deepspeed": 240, "sleep": 240, "nccl": 240}  # seconds; the three stay under 10 minutes
GIB = 1024**3


def cuda_refusal() -> str:
    """"" where CUDA is usable, else why this check cannot run here."""
    try:
        import torch
    except ImportError as e:
        return f"torch is not importable: {e}"
    if not torch.cuda.is_available():
        return (f"no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda or 'none'}): "
                "bench/gpu_check.py measures NCCL transfer, vLLM sleep/wake and DeepSpeed offload on a GPU, "
                "and has nothing to measure on CPU")
    return ""


def build_model(out: Path) -> Path:
    """A ~1.1B-parameter Llama with random bf16 weights and the tiny tokenizer files (no network)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (out / "config.json").exists():
        return out
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                      num_key_value_heads=16, vocab_size=32000, max_position_embeddings=2048,
                      tie_word_embeddings=False, torch_dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    from seamlessflow.modelgen import init_model  # the tokenizer and chat template vLLM expects beside it

    with tempfile.TemporaryDirectory() as tmp:
        init_model(Path(tmp) / "tiny", size="tiny")
        for f in (Path(tmp) / "tiny").iterdir():
            if f.name.startswith(("tokenizer", "special_tokens")) or f.name == "chat_template.jinja":
                (out / f.name).write_bytes(f.read_bytes())
    return out


def allocated_gib() -> float:
    import torch

    torch.cuda.synchronize()
    return round(torch.cuda.memory_allocated() / GIB, 2)


def used_gib(device: int = 0) -> float:
    """Device memory in use by every process (vLLM's live in its engine process)."""
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return round((total - free) / GIB, 2)


# -- stages --------------------------------------------------------------------------------------

def stage_deepspeed(model: Path) -> dict:
    from services.trainer.config import TrainerConfig
    from services.trainer.dp_check import synthetic_groups
    from services.trainer.engine import TrainEngine
    from services.trainer.runner import Command, Runner, encode_groups

    cfg = TrainerConfig(model_dir=str(model), zero_stage=2, dtype="bf16", lr=1e-6, micro_batch_tokens=2048,
                        gradient_checkpointing=True, scheduler_gate=True)  # the gate: lending must be allowed
    t0 = time.perf_counter()
    eng = TrainEngine(cfg)
    runner = Runner(eng, tempfile.mkdtemp(prefix="gpu-check-ckpt-"))
    init_s = time.perf_counter() - t0
    step = runner.execute(Command("train", step=1, batch=encode_groups(synthetic_groups(1, vocab=32000)), version=1))
    before = allocated_gib()
    off = runner.execute(Command("offload"))
    offloaded = allocated_gib()
    on = runner.execute(Command("reload"))
    after = allocated_gib()
    return {"stage": "deepspeed", "init_s": round(init_s, 1), "step_s": round(step["metrics"]["compute_s"], 2),
            "offload_s": round(off["offload_s"], 3), "reload_s": round(on["reload_s"], 3),
            "allocated_gib": before, "offloaded_gib": offloaded, "reloaded_gib": after,
            "freed_share": round(1 - offloaded / before, 3) if before else 0.0}


def _llm(model: Path, **extra):
    from vllm import LLM

    return LLM(model=str(model), dtype="bfloat16", enable_sleep_mode=True, gpu_memory_utilization=0.5,
               max_model_len=2048, enforce_eager=True, seed=0, **extra)


def _timed(fn, *args, **kw) -> float:
    t0 = time.perf_counter()
    fn(*args, **kw)
    return round(time.perf_counter() - t0, 3)


def stage_sleep(model: Path) -> dict:
    from vllm import SamplingParams

    t0 = time.perf_counter()
    llm = _llm(model)
    start_s = time.perf_counter() - t0
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    prompt = {"prompt_token_ids": [1, 2, 3, 4]}
    first = llm.generate(prompt, greedy)[0].outputs[0].token_ids
    awake = used_gib()
    out = {"stage": "sleep", "start_s": round(start_s, 1), "awake_used_gib": awake}
    out["sleep1_s"] = _timed(llm.sleep, level=1)
    out["sleep1_used_gib"] = used_gib()
    out["wake1_s"] = _timed(llm.wake_up)
    out["same_tokens_after_level1"] = llm.generate(prompt, greedy)[0].outputs[0].token_ids == first
    out["sleep2_s"] = _timed(llm.sleep, level=2)
    out["sleep2_used_gib"] = used_gib()
    out["wake_weights_s"] = _timed(llm.wake_up, tags=["weights"])
    out["weights_only_used_gib"] = used_gib()
    # the update a lend does between the two stages: here the same weights, from the model dir
    out["reload_s"] = _timed(llm.collective_rpc, "reload_weights", kwargs={"weights_path": str(model)})
    out["wake_kv_s"] = _timed(llm.wake_up, tags=["kv_cache"])
    out["same_tokens_after_level2"] = llm.generate(prompt, greedy)[0].outputs[0].token_ids == first
    return out


class _LocalClient:
    """vLLM's VLLMWeightSyncClient protocol over an in-process `LLM` (its workers by collective_rpc)."""

    def __init__(self, llm):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info):
        self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})

    def start_weight_update(self):
        self.llm.collective_rpc("start_weight_update")

    def update_weights(self, update_info):
        self.llm.collective_rpc("update_weights", kwargs={"update_info": update_info})

    def finish_weight_update(self, weight_version=None):
        self.llm.collective_rpc("finish_weight_update")


def stage_nccl(model: Path) -> dict:
    import socket

    import torch
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

    if torch.cuda.device_count() < 2:
        return {"stage": "nccl", "skipped": "needs 2 GPUs: NCCL refuses two ranks on one device "
                f"(this machine has {torch.cuda.device_count()}); one GPU shares weights over the ipc backend"}
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0,1")
    llm = _llm(model, weight_transfer_config={"backend": "nccl"})  # the engine on cuda:0
    trainer = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).to("cuda:1")
    gb = sum(p.numel() * p.element_size() for p in trainer.parameters()) / 1e9
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(1)
    t0 = time.perf_counter()
    engine = NCCLTrainerWeightTransferEngine.trainer_init(
        NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=port, world_size=2),
        client=_LocalClient(llm), source=ModuleSource(trainer))
    init_s = time.perf_counter() - t0
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        engine.send_weights()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    best = min(times)
    engine.shutdown()
    return {"stage": "nccl", "gb": round(gb, 2), "init_s": round(init_s, 2), "transfer_s": round(best, 3),
            "gb_per_s": round(gb / best, 2), "all_s": [round(t, 3) for t in times]}


RUN = {"deepspeed": stage_deepspeed, "sleep": stage_sleep, "nccl": stage_nccl}


# -- driver --------------------------------------------------------------------------------------

def run_stage(stage: str, model: Path) -> dict:
    """One stage in a process of its own (the device whole at its start), bounded by its timeout."""
    cmd = [sys.executable, __file__, "--stage-child", stage, "--model", str(model)]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=STAGE_TIMEOUT[stage],
                           env=dict(os.environ, PYTHONPATH=str(ROOT)))
    except subprocess.TimeoutExpired:
        return {"stage": stage, "failed": f"no result within {STAGE_TIMEOUT[stage]} s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"stage": stage, "failed": f"exit {p.returncode}: {p.stderr[-1500:]}"}
    return json.loads(lines[-1]) | {"wall_s": round(time.perf_counter() - t0, 1)}


def table(rows: list[dict]) -> str:
    out = ["| stage | result |", "|---|---|"]
    for r in rows:
        body = ", ".join(f"{k} {v}" for k, v in r.items() if k not in ("stage",))
        out.append(f"| {r['stage']} | {body} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=STAGES, action="append", help="run these stages only (repeatable)")
    ap.add_argument("--model", help="an HF model dir to use instead of the built ~1B one")
    ap.add_argument("--out", help="write results.json (and the built model) here")
    ap.add_argument("--stage-child", choices=STAGES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if why := cuda_refusal():
        print(f"gpu_check refused: {why}", file=sys.stderr)
        return 2
    if args.stage_child:  # inside one stage's process
        sys.path.insert(0, str(ROOT))
        print(json.dumps(RUN[args.stage_child](Path(args.model))), flush=True)
        return 0
    work = Path(args.out or tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = Path(args.model) if args.model else build_model(work / "model-1b")
    rows = [{"stage": "model", "path": str(model), "build_s": round(time.perf_counter() - t0, 1)}]
    for stage in args.only or STAGES:
        row = run_stage(stage, model)
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(table(rows))
    (work / "results.json").write_text(json.dumps(rows, indent=1))
    return 1 if any("failed" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
