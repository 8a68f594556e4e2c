"""Where the time of vLLM's `add_lora` goes inside the worker (issue 27's LoRA stall).

    flock /tmp/heavy.lock .venv/bin/python bench/probe_adapter_load.py -n 40   # ~1 min on 2 cores

vLLM in this process (no engine-core process), the tiny model with enable_lora and the stall
benchmark's adapters (r 8, every projection). vLLM's own functions are wrapped with timers, and
`add_lora` is called N times (each a new id, the old one removed):
  peft     PEFTHelper.from_local_dir (adapter_config.json)
  read     safetensors: open the file, read every tensor
  build    LoRAModel.from_lora_tensors (LoRALayerWeights per module, dtype casts)
  merge    LoRAModelManager._create_merged_loras_inplace (pack qkv / gate_up, optimize)
  activate LoRAModelManager.activate_adapter (copy into the stacked LoRA buffers)
  total    LRUCacheWorkerLoRAManager.add_adapter, all of the above

What it found (session 23, docs/history/benchmarks-log.md, "Where add_lora's time goes"): the
worker's whole part is ~1.2 ms median, so most of the 14.5 ms the rollout engine waits on
`add_lora` in the stall benchmark is the trip through the processes and the step in progress.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.weight_update_stall import make_adapter  # noqa: E402
from seamlessflow.modelgen import init_model  # noqa: E402


def _timed(owner, name: str, into: dict[str, list[float]], key: str) -> None:
    fn = getattr(owner, name)

    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            into.setdefault(key, []).append(1000 * (time.perf_counter() - t0))

    setattr(owner, name, wrapper)


def breakdown(tmp: Path, n: int, model: str | None = None) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker lives in this process: its functions can be wrapped
    import safetensors
    from vllm import LLM
    from vllm.lora import lora_model, model_manager, peft_helper, worker_manager
    from vllm.lora.request import LoRARequest

    model = Path(model) if model else init_model(tmp / "model")
    dirs = [make_adapter(model, tmp / f"a{i}", i, 8) for i in range(4)]
    llm = LLM(model=str(model), dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=16,
              skip_tokenizer_init=True, enable_lora=True, max_loras=4, max_lora_rank=8)
    ms: dict[str, list[float]] = {}
    _timed(peft_helper.PEFTHelper, "from_local_dir", ms, "peft")
    _timed(lora_model.LoRAModel, "from_lora_tensors", ms, "build")
    _timed(lora_model.LoRAModel, "from_local_checkpoint", ms, "read+build")
    _timed(model_manager.LoRAModelManager, "_create_merged_loras_inplace", ms, "merge")
    _timed(model_manager.LRUCacheLoRAModelManager, "activate_adapter", ms, "activate")
    _timed(worker_manager.LRUCacheWorkerLoRAManager, "add_adapter", ms, "total")
    _timed(worker_manager.WorkerLoRAManager, "_load_adapter", ms, "load")
    engine = llm.llm_engine
    t_read = []
    for i in range(n):
        path = str(dirs[i % len(dirs)])
        t0 = time.perf_counter()
        with safetensors.safe_open(f"{path}/adapter_model.safetensors", framework="pt") as f:
            {k: f.get_tensor(k) for k in f.keys()}
        t_read.append(1000 * (time.perf_counter() - t0))
        t0 = time.perf_counter()
        assert engine.add_lora(LoRARequest(f"a{i}", i + 1, path))
        ms.setdefault("add_lora (engine call)", []).append(1000 * (time.perf_counter() - t0))
        if i:
            engine.remove_lora(i)
    ms["read (alone, warm cache)"] = t_read
    print(f"{n} add_lora calls, tiny model, r 8 on every projection; ms, median / max (first dropped)")
    for k, v in ms.items():
        v = v[1:]
        print(f"  {k:26s} {statistics.median(v):7.2f} / {max(v):7.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=40, help="add_lora calls (the first is dropped from the figures)")
    ap.add_argument("--model", help="a checkpoint already built (default: the tiny model, built here)")
    args = ap.parse_args()
    if args.n < 2:
        ap.error("-n must be at least 2: the first call is dropped")
    tmp = Path(tempfile.mkdtemp(prefix="sf-adapter-probe-"))
    breakdown(tmp, args.n, args.model)


if __name__ == "__main__":
    main()
