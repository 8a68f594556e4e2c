"""Every benchmark runs at a tiny size with its documented command, so that a change which breaks a
benchmark or its flags fails the suite instead of the next person who measures.

Each case runs the script as its docstring says (`.venv/bin/python bench/NAME.py ...`, from the
repository root) in a process group of its own with a timeout, and checks that it exited 0 and printed
its result: a figure parsed from what it printed (or wrote with --out), and found > 0. At these sizes,
on a shared machine, the figures mean nothing; the checks only show that they are there.

Markers: `bench` on every case; `integration` where the benchmark starts NATS and Redis (with the
SIMULATED engine); `vllm` / `deepspeed` where it starts one (those run in `just test`, not in
`just test-fast`); `slow` as pyproject.toml says. The last test checks that every bench/*.py is run
here, or says which case runs it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The SIMULATED engine's command after the interpreter (up --worker-cmd, the fault harness and the stack
# fixture run it; every stack benchmark below runs it inside the real rollout worker).
ENGINE = ["-m", "services.rollout.simulated"]

pytestmark = pytest.mark.bench

FIGURE = r"(\d+(?:\.\d+)?)"


def run(argv: list[str], timeout: float, expect_rc: int = 0) -> str:
    """`python ARGV...` from the repository root; its stdout, after checking it exited `expect_rc` (0), and
    its stderr after that where a refusal is expected. The process group is killed on a timeout, so a
    benchmark's stack does not outlive it."""
    p = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"{' '.join(argv)}: no result in {timeout:.0f} s\n{out[-3000:]}\n{err[-3000:]}")
    assert p.returncode == expect_rc, f"{' '.join(argv)} exited {p.returncode}\n{out[-3000:]}\n{err[-3000:]}"
    return out if expect_rc == 0 else out + err


def bench(name: str, *args: str, timeout: float = 120, expect_rc: int = 0) -> str:
    return run([f"bench/{name}", *args], timeout, expect_rc)


def figures(pattern: str, text: str) -> list[float]:
    """Every group of every match of `pattern`, in order, as numbers (at least one)."""
    found = [float(x) for m in re.finditer(pattern, text) for x in m.groups()]
    assert found, f"no line matches {pattern!r} in:\n{text[-3000:]}"
    return found


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{") and line.endswith("}")]


# -- simulated: no servers, no model ---------------------------------------------------------------

def test_pipeline(tmp_path):
    out = bench("pipeline.py", "--steps", "1", "--sweep-steps", "1", "--skip-scale", "--skip-drain",
                "--out", str(tmp_path))
    assert "**Goals**" in out
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["long-tail-64"]["policies"]["seamless"]["trained_tok_s"] > 0
    assert report["goals"] and all(g["measured"] >= 0 for g in report["goals"])


def test_pipeline_one_gpu_with_rebalance(tmp_path):
    out = bench("pipeline.py", "--steps", "1", "--only-one-gpu", "--rebalance", "--out", str(tmp_path))
    assert "--rebalance --only-one-gpu" in out and "one-gpu: seamless / disaggregated, split 60 of 64" in out
    report = json.loads((tmp_path / "results.json").read_text())
    assert len(report["one-gpu"]["sweep"]) == 14 and report["one-gpu"]["colocated"]["trained_tok_s"] > 0


def test_pipeline_breakdown():
    out = bench("pipeline_breakdown.py", "--steps", "2", "--no-diagnostics")
    tok_s = figures(rf"steps\*\*: {FIGURE} tok/s", out.replace(",", ""))
    assert len(tok_s) == 4 and all(x > 0 for x in tok_s)


# -- a tokenizer, no servers -----------------------------------------------------------------------

def test_cold_calls(tiny_model):
    out = bench("cold_calls.py", "--model", str(tiny_model), "--calls", "5")
    rows = figures(rf"\| tokenizer encode \| 2 ms \| {FIGURE} µs", out)
    assert rows[0] > 0


def test_stopstrings(tiny_model):
    [row] = json_lines(bench("stopstrings.py", "--model", str(tiny_model), "--tokens", "100", "--repeats", "1"))
    assert row["tokens"] == 100 and row["us_per_token_4_stops"] > 0 and row["us_per_token_no_stops"] > 0


# -- plain torch and transformers, no servers ------------------------------------------------------

def test_probe_learning(tmp_path):
    """`prepare` (the tiny model, one warm-start step) then `run` (two RL steps, evaluated on 8 prompts)."""
    out = bench("probe_learning.py", "prepare", "--dir", str(tmp_path), "--targets", "--warm-steps", "1")
    assert "steps 1:" in out
    out = bench("probe_learning.py", "run", "--model", str(tmp_path / "warmsteps1"), "--steps", "2",
                "--eval-every", "2", "--eval-n", "8", "--groups-per-step", "2", "--group-size", "2")
    res = json_lines(out)[-1]
    assert set(res["eval"]) == {"0", "2"} and len(res["batch_reward"]) == 2 and res["sec_per_step"] > 0


def test_plot_probe_calc(tmp_path):
    """Two runs' summary lines (one with its step-0 eval, one without) drawn into one PNG."""
    def summary(evals: dict) -> str:
        return json.dumps({"entropy": [2.4, 1.9], "batch_exact": [0.0, 0.1], "batch_train_reward": [0.1, 0.3],
                           "eval": {s: {"sampled_lenient": v, "greedy_lenient": v + 0.3} for s, v in evals.items()}})
    (tmp_path / "a.log").write_text("step 1 ...\n" + summary({"0": 0.1, "2": 0.3}) + "\n")
    (tmp_path / "b.log").write_text(summary({"2": 0.2}) + "\n")
    png = tmp_path / "out.png"
    bench("plot_probe_calc.py", str(png), f"seed 0={tmp_path / 'a.log'}", f"seed 1={tmp_path / 'b.log'}")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    # the exact rate, b's step 0 from a's (--base: the SFT run that saved the start)
    (tmp_path / "c.log").write_text(json.dumps({"entropy": [0.5], "batch_exact": [0.3], "batch_distinct": [4.5],
                                                "eval": {"1": {"sampled_exact": 0.4, "greedy_exact": 0.5}}}) + "\n")
    (tmp_path / "a.log").write_text(json.dumps({"eval": {"0": {"sampled_exact": 0.2, "greedy_exact": 0.3}}}) + "\n")
    png.unlink()
    bench("plot_probe_calc.py", str(png), "--metric", "exact", "--base", str(tmp_path / "a.log"),
          f"seed 0={tmp_path / 'c.log'}")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- a stack on NATS and Redis, the SIMULATED engine -----------------------------------------------

def test_simulated_engine_parses_its_documented_flags():
    """Its run needs a NATS server: every stack case below runs it inside the real rollout worker."""
    out = run([*ENGINE, "--help"], timeout=60)
    assert "--worker-id" in out and "--capacity" in out


@pytest.mark.integration
def test_gateway_overhead_simulated(tiny_model):
    out = bench("gateway_overhead.py", "--engine", "simulated", "--concurrency", "1", "--requests", "8",
                "--rounds", "1", "--idle", "0", "--model", str(tiny_model))
    direct, gateway = figures(rf"\| \S+ \| 1 \| {FIGURE} / [\d.]+ \| {FIGURE} / ", out)[:2]
    assert direct > 0 and gateway > 0


@pytest.mark.integration
@pytest.mark.slow  # a second stack start (~10 s) for a mode; the case above runs the same stack and engine
def test_gateway_overhead_one_long_session(tiny_model):
    out = bench("gateway_overhead.py", "--engine", "simulated", "--turns", "10", "--sessions", "1", "--idle", "0",
                "--model", str(tiny_model))
    assert figures(rf"\| \S+ \| 10 \| {FIGURE} \| ", out)[0] > 0


@pytest.mark.integration
def test_hop_floor(tiny_model):
    rows = json_lines(bench("hop_floor.py", "--concurrency", "1", "--requests", "8", "--rounds", "1",
                            "--model", str(tiny_model)))
    sides = {r["side"]: r for r in rows if "side" in r}
    assert set(sides) == {"services", "floor"}
    assert all(r["p50_ms"] > 0 and r["turns"] >= 8 for r in sides.values())


@pytest.mark.integration
def test_load(tmp_path, tiny_model):
    bench("load.py", "--sessions", "4", "--seconds", "2", "--warmup", "1", "--replicas", "1", "--procs", "1",
          "--workers", "1", "--model", str(tiny_model), "--out", str(tmp_path / "load.json"))
    [row] = json.loads((tmp_path / "load.json").read_text())["rows"]
    assert row["turns"] > 0 and row["turns_per_s"] > 0
    assert row["error_count"] == 0, row["errors"]


@pytest.mark.integration
def test_scheduler_scale(tmp_path):
    bench("scheduler_scale.py", "--hosts", "4", "--train-hosts", "1", "--seconds", "3", "--period", "1",
          "--out", str(tmp_path / "scale.json"))
    r = json.loads((tmp_path / "scale.json").read_text())
    assert r["hosts"] == 4 and r["assignments_per_s"] > 0


@pytest.mark.integration
def test_pipeline_live(tmp_path, tiny_model):
    """The live stack (scheduler, host agents with SIMULATED engines, bench/sim_trainer.py) beside the
    simulator."""
    out = bench("pipeline_live.py", "--hosts", "2", "--steps", "3", "--warmup", "1", "--timeout", "120",
                "--model", str(tiny_model), "--out", str(tmp_path / "live.json"), timeout=240)
    assert "failed turns 0" in out
    r = json.loads((tmp_path / "live.json").read_text())
    assert r["live"]["trained_tokens_per_s"] > 0 and r["sim"]["trained_tokens_per_s"] > 0


# -- vLLM or DeepSpeed: `just test` only -----------------------------------------------------------

@pytest.mark.integration
@pytest.mark.vllm
def test_gateway_overhead_vllm(tiny_model):
    out = bench("gateway_overhead.py", "--concurrency", "1", "--requests", "4", "--rounds", "1", "--idle", "0",
                "--model", str(tiny_model), timeout=600)
    assert figures(rf"\| \S+ \| 1 \| {FIGURE} / ", out)[0] > 0


@pytest.mark.integration
@pytest.mark.vllm
def test_weight_update_stall(tiny_model):
    """Five phases on two stacks: each phase 2 s with one disturbance at 1 s (keep, abort, lora)."""
    out = bench("weight_update_stall.py", "--agents", "2", "--workers", "1", "--seconds", "2", "--every", "1",
                "--warmup", "1", "--max-tokens", "8", "--model", str(tiny_model), timeout=600)
    phases = {r["phase"]: r for r in json_lines(out) if "phase" in r}
    assert set(phases) == {"baseline", "keep", "abort", "lora-baseline", "lora"}
    assert all(r["requests"] > 0 for r in phases.values())
    assert phases["lora"]["events"] > 0 and phases["lora"]["tokens_lost"] == 0
    assert "gap_net_p50_ms" in phases["lora"]  # the lora phases stream: the pause at each update is measured


@pytest.mark.integration
@pytest.mark.deepspeed
def test_train_step(tmp_path, tiny_model):
    bench("train_step.py", "--models", f"tiny={tiny_model}", "--steps", "1", "--warmup", "0", "--groups", "1", "--group-size", "2",
          "--prompt", "8", "--generated", "8", "--json", str(tmp_path / "rows.json"), timeout=600)
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert {r["path"] for r in rows} == {"plain", "zero0", "zero2"} and all(r["tokens_per_s"] > 0 for r in rows)


def test_pipeline_colocated_gap():
    out = bench("pipeline_colocated_gap.py", "--steps", "1", "--split", "48", timeout=300)
    rows = [line for line in out.splitlines() if line.startswith("| seamless") or line.startswith("| colocated")]
    assert len(rows) == 11 and all(figures(r"^\| [^|]+ \| ([\d,]+)", r.replace(",", ""))[0] > 0 for r in rows)


@pytest.mark.integration
def test_ha_costs():
    out = bench("ha_costs.py", "--n", "20", "--rounds", "1", timeout=300)
    for side in ("publish R1", "publish R3", "turn, no WAIT", "turn, WAIT 1"):
        assert figures(re.escape(side) + r"\s+median\s+" + FIGURE + " ms", out)[0] > 0, side


@pytest.mark.integration
@pytest.mark.slow  # ~30 s: 4 NATS clusters and a Sentinel group start (pyproject.toml)
def test_ha_stack(tmp_path):
    """4 stacks (R1/R3 streams x WAIT 0/1) on 4 NATS clusters and one Sentinel group, 2 agents, 1 round."""
    bench("ha_stack.py", "--rounds", "1", "--seconds", "1", "--warmup", "0.5", "--lanes", "1", "--group-size", "2",
          "--turns", "2", "--out", str(tmp_path / "ha.json"), timeout=240)
    r = json.loads((tmp_path / "ha.json").read_text())
    assert [row["stream_replicas"] for row in r["rows"].values()] == [1, 1, 3, 3]
    assert all(row["turns"] > 0 and row["failed_turns"] == 0 for row in r["rows"].values()), r["rows"]
    assert r["ratios"]["R1, no WAIT"]["turns_per_s"] == 1.0


@pytest.mark.integration
@pytest.mark.deepspeed
def test_lora_costs(tmp_path, tiny_model):
    bench("lora_costs.py", "--models", f"tiny={tiny_model}", "--steps", "1", "--warmup", "0", "--groups", "1", "--group-size", "2",
          "--prompt", "8", "--generated", "8", "--json", str(tmp_path / "rows.json"), timeout=600)
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert {r["mode"] for r in rows} == {"full", "lora"}
    assert all(r["step_s_median"] > 0 and r["version_mb"] > 0 for r in rows)
    by_mode = {r["mode"]: r for r in rows}
    assert by_mode["lora"]["version_mb"] < by_mode["full"]["version_mb"]  # an adapter, not the model


@pytest.mark.integration
@pytest.mark.vllm
def test_probe_adapter_load(tiny_model):
    out = bench("probe_adapter_load.py", "-n", "3", "--model", str(tiny_model), timeout=600)
    total, engine_call = figures(r"total\s+" + FIGURE, out)[0], figures(r"add_lora \(engine call\)\s+" + FIGURE, out)[0]
    assert 0 < total <= engine_call  # the worker's part is inside the engine's call


@pytest.mark.integration
@pytest.mark.vllm
@pytest.mark.deepspeed
def test_scheduler_ab(tmp_path, tiny_model):
    bench("scheduler_ab.py", "--seconds", "3", "--policies", "seamless", "--lanes", "2", "--min-tokens", "4",
          "--max-tokens", "16", "--model", str(tiny_model), "--out", str(tmp_path / "ab.json"), timeout=600)
    [row] = json.loads((tmp_path / "ab.json").read_text())
    assert row["policy"] == "seamless"


def test_weight_sync(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("bench/weight_sync.py makes network namespaces: needs root")
    out = bench("weight_sync.py", "--sizes", "10M", "--links", "1", "--repeat", "1", "--tcp-mb", "16",
                "--workdir", str(tmp_path), timeout=180)
    assert figures(r"net_GBps=" + FIGURE, out)[0] > 0 and figures(r"disk_s=" + FIGURE, out)[0] > 0
    assert figures(r"tcp_GBps=" + FIGURE, out)[0] > 0
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "sfws-" not in listed  # the namespaces are gone


# -- every benchmark is here -----------------------------------------------------------------------

# bench/ files that are parts of a benchmark, not one: the case that runs each
PARTS = {
    "cpu_cap.py": "load.py --replica-cpu (root and a cgroup cpu controller): tests/unit/test_bench_load.py",
    "sim_trainer.py": "test_pipeline_live (its trainer)",
}


# -- the namespace cluster (root and iproute2) ---------------------------------------------------------

@pytest.mark.cluster
def test_cluster():
    from tests.cluster.netns import unavailable_reason

    if why := unavailable_reason():
        pytest.skip(f"no namespace cluster here: {why}")
    [row] = json_lines(bench("cluster.py", "--hosts", "2", "--rate-mbit", "100", "--mb", "4", "--requests", "20"))
    assert row["tcp_gbit_s"] > 0 and row["nats_rtt_p50_ms"] > 0 and row["line_share"] > 0


# -- a GPU, where one is lent -------------------------------------------------------------------------

def test_gpu_check_refuses_clearly_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: run bench/gpu_check.py itself (minutes), not its refusal")
    out = bench("gpu_check.py", "--only", "sleep", timeout=60, expect_rc=2)
    assert "gpu_check refused: no CUDA device" in out and "nothing to measure on CPU" in out


def test_every_benchmark_has_a_smoke_run():
    source = Path(__file__).read_text()
    run_here = set(re.findall(r'bench\("(\w+\.py)"', source))
    missing = {p.name for p in (ROOT / "bench").glob("*.py")} - run_here - set(PARTS)
    assert not missing, f"bench/ scripts with no smoke run in {Path(__file__).name}: {sorted(missing)}"
