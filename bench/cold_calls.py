"""What one call costs back to back, and when it comes every few milliseconds as a 1-session turn does.

    .venv/bin/python bench/cold_calls.py [--model DIR] [--calls 100]

At 1 session a turn's code runs once every ~20 ms (the engine's time), at 64 back to back. This
times two calls a turn makes, with CPU time of the calling thread (`time.thread_time`), after pauses
of 0 to 20 ms, spent spinning (the CPU stays busy: no idle state) or asleep: the prompt's encode by
the model's tokenizer (the Rust `tokenizers` library, as services/trajectory/rendering.py calls it)
and a pure-Python stand-in (json.dumps of 20 messages, 10 times). A cost that grows with the pause
is the caches going cold between calls: the machine's, not the code's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as the stack runs the services


def per_call_us(fn, pause: float, sleep: bool, n: int = 100) -> float:
    total = 0.0
    for _ in range(n):
        t = time.thread_time()
        fn()
        total += time.thread_time() - t
        if pause and sleep:
            time.sleep(pause)
        elif pause:
            end = time.perf_counter() + pause
            while time.perf_counter() < end:
                pass
    return total / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a checkpoint directory (default: the tiny model, built here)")
    ap.add_argument("--calls", type=int, default=100, help="calls timed per figure")
    args = ap.parse_args()
    from seamlessflow.modelgen import init_model
    from services.trajectory.rendering import Renderer

    model = args.model or init_model(Path(tempfile.mkdtemp(prefix="sf-cold-")) / "model")
    r = Renderer.from_pretrained(str(model))
    text = r.render([{"role": "user", "content": "hello world, please reverse 12345"}], [], gen=True)
    messages = [{"role": "user", "content": f"hello world {i}"} for i in range(20)]
    calls = {"tokenizer encode": lambda: r.encode(text),
             "json.dumps x10": lambda: [json.dumps(messages) for _ in range(10)]}
    print("| call | pause | back to back | spinning | asleep |")
    print("|---|---|---|---|---|")
    for name, fn in calls.items():
        fn()
        base = per_call_us(fn, 0, False, args.calls)
        for pause in (0.002, 0.005, 0.02):
            print(f"| {name} | {pause * 1000:g} ms | {base:.1f} µs | {per_call_us(fn, pause, False, args.calls):.1f} µs | "
                  f"{per_call_us(fn, pause, True, args.calls):.1f} µs |", flush=True)


if __name__ == "__main__":
    main()
