"""What the SIMULATED cluster runs: host costs (a calibration) and the RL workload.

    from services.scheduler.sim.workload import CALIBRATIONS, Workload
    cal = CALIBRATIONS["decode-heavy"]; wl = Workload(groups_per_step=64, group_size=16)

A `Calibration` is what one host (by default an 8-accelerator host) costs: a decode step of
`decode_a_s + decode_b_s * k` seconds for `k` running sequences (up to `max_seqs`), prefill
per prompt token, training per token, a weight sync, and the switch costs of lending and
reclaiming. A host's capacity weight divides every cost. The figures and their sources are
in docs/capacity-planning.md; `live-mini` mirrors services/rollout/simulated.py for comparing
the simulator with a small live run.

A `Workload` is GRPO: `groups_per_step` groups of `group_size` sessions per trainer step;
each session is `turns` model turns with `tool_latency_s` (and `tool_tokens` of tool
output to prefill) between them, and response lengths drawn per turn from a capped
lognormal or Pareto. This module knows nothing about policies or time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import numpy as np


@dataclass(frozen=True, slots=True)
class Calibration:
    name: str
    decode_a_s: float  # seconds per decode step, fixed part (one host)
    decode_b_s: float  # seconds per decode step per running sequence
    max_seqs: int  # K: sequences a host decodes at once (KV-cache bound)
    prefill_s_per_token: float
    train_s_per_token: float  # one host, everything a trained token costs (fwd, bwd, logprob passes)
    weight_sync_s: float  # trainer: publish a version; rollout host: load it in place (weight_load_s)
    lend_s: float  # train -> rollout: offload trainer state, wake, load weights, resume
    reclaim_s: float  # rollout -> train: vacate, sleep, reload trainer state
    source: str = ""
    # what a request's prefill costs: False (a real engine's, as calibrated) its tokens x
    # prefill_s_per_token, a stall in which the host decodes nothing; True (services/rollout/simulated.py,
    # the live runs' stand-in engine) one decode step of its own whatever its context, in which the host's
    # other requests decode on. prefill_s_per_token is then read only by the routing rules' cost estimates
    prefill_one_step: bool = False
    # seconds a rollout host stalls to load a published version in place; None: weight_sync_s (the
    # trainer's publish), as before. The stand-in engine's load is a version number (instant): 0
    weight_load_s: float | None = None
    # the trainer's own time per step outside compute and publish (bench/pipeline_live.py measures them on
    # the live trainer; 0, the default, leaves them out). bookkeeping_s: after the version is out, the
    # trainer still counts as publishing (the audit record, a checkpoint every few steps amortised, the
    # step's metrics, its status); it overlaps a wait for data. gate_s: from the batch in hand and the
    # pool reclaimed to the gate's answer (its round trip through the scheduler); the train host waits,
    # idle. start_s: then to the compute's start (the status, the batch encoded and handed to the
    # runner); the trainer counts as computing
    bookkeeping_s: float = 0.0
    gate_s: float = 0.0
    start_s: float = 0.0

    def step_s(self, k: float) -> float:
        return self.decode_a_s + self.decode_b_s * k

    def train_tokens_per_s(self) -> float:
        return 1.0 / self.train_s_per_token


# Derivations and citations: docs/capacity-planning.md ("Calibrations").
CALIBRATIONS: dict[str, Calibration] = {
    # Llama-3.1-8B on an 8xH100 host, 8 data-parallel vLLM engines (Lambda: 3,400 output tok/s
    # at 19.75 ms ITL per H100), KV-bound at 64 long sequences per GPU; training from
    # torchtitan's 2,973 tok/s/GPU (A100) scaled to H100 and to RL's extra logprob passes.
    "decode-heavy": Calibration(
        "decode-heavy", decode_a_s=0.010, decode_b_s=0.145e-3 / 8, max_seqs=512,
        prefill_s_per_token=1 / (8 * 15_000), train_s_per_token=1 / (8 * 4_500),
        weight_sync_s=3.0, lend_s=9.1, reclaim_s=3.3,
        source="vLLM Lambda benchmark (8B, H100) + torchtitan (8B) scaled; verl switch times"),
    # Qwen2.5-32B-class model on an 8xH100 host: training ~4x the 8B cost per token (FLOPs),
    # rollout 2 TP-4 engines; this machine's DeepSpeed-vs-vLLM ratio for the medium model
    # (train 767 tok/s vs decode 1.1k tok/s at batch 16) says training dominates at this size.
    "train-heavy": Calibration(
        "train-heavy", decode_a_s=0.020, decode_b_s=0.060e-3, max_seqs=512,
        prefill_s_per_token=1 / (8 * 4_000), train_s_per_token=1 / (8 * 1_100),
        weight_sync_s=8.0, lend_s=9.1, reclaim_s=3.3,
        source="scaled from the 8B figures by parameter count; ratio checked against this machine"),
    # services/rollout/simulated.py's default speeds (one step = 2 ms + 0.25 ms per running
    # request, capacity 64) and the tiny model's DeepSpeed ZeRO-0 step (17,123 tok/s) on
    # one CPU host: the configuration for comparing the simulator with a live run.
    "live-mini": Calibration(
        "live-mini", decode_a_s=0.002, decode_b_s=0.00025, max_seqs=64,
        prefill_s_per_token=0.002 / 32, train_s_per_token=1 / 17_123,
        weight_sync_s=0.05, lend_s=0.5, reclaim_s=0.5,
        source="services/rollout/simulated.py defaults; BENCHMARKS.md trainer step (tiny, zero0)"),
    # an independent model's default (issue 29), hosts of ONE accelerator: decode 12 ms + 0.2 ms per
    # running sequence up to 64, training 2.8 ms per token per host, weight sync 10 s, switches 5 s each
    # way. It states no prefill: 15 k tok/s is decode-heavy's per-GPU assumption, so that a re-prefilled
    # token costs 0.17x a token decoded at full batch (docs/capacity-planning.md, "one-gpu").
    "one-gpu": Calibration(
        "one-gpu", decode_a_s=0.012, decode_b_s=0.0002, max_seqs=64,
        prefill_s_per_token=1 / 15_000, train_s_per_token=0.0028,
        weight_sync_s=10.0, lend_s=5.0, reclaim_s=5.0,
        source="an independent model's default calibration (issue 29); prefill assumed as decode-heavy's per GPU"),
}


@dataclass(frozen=True, slots=True)
class Workload:
    group_size: int = 16
    groups_per_step: int = 64
    prompt_tokens: int = 512
    turns: int = 1
    tool_latency_s: float = 0.0  # between turns
    tool_tokens: int = 0  # tool output appended (and prefilled) between turns
    length: Literal["lognormal", "pareto", "fixed"] = "lognormal"
    length_median: float = 1024.0  # lognormal median; Pareto scale (minimum); fixed value
    length_sigma: float = 1.0  # lognormal sigma
    length_alpha: float = 1.5  # Pareto shape
    length_cap: int = 16_384
    max_staleness: int = 1  # the trajectory manager's admission bound (shared/admission.py)

    @property
    def batch_samples(self) -> int:
        return self.group_size * self.groups_per_step

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Response lengths (tokens) of `n` turns."""
        if self.length == "fixed":
            x = np.full(n, self.length_median)
        elif self.length == "lognormal":
            x = self.length_median * np.exp(self.length_sigma * rng.standard_normal(n))
        else:
            x = self.length_median * (1.0 + rng.pareto(self.length_alpha, n))
        return np.clip(np.round(x), 1, self.length_cap)

    def mean_length(self, n: int = 200_000, seed: int = 1) -> float:
        return float(self.draw(np.random.default_rng(seed), n).mean())


WORKLOADS: dict[str, Workload] = {
    # single-turn reasoning, long tail: lognormal median 2k tokens, sigma 1.0, capped at 16k
    "long-tail": Workload(group_size=16, groups_per_step=32, prompt_tokens=512, length_median=2048,
                          length_sigma=1.0, length_cap=16_384),
    # agentic: 4 turns of ~300 tokens, 2 s tools with 200 tokens of output each
    "agentic": Workload(group_size=8, groups_per_step=32, prompt_tokens=1024, turns=4, tool_latency_s=2.0,
                        tool_tokens=200, length_median=300, length_sigma=0.8, length_cap=4096),
    # what `services/rollout/simulated.py` live runs use: 4 groups x 8 sessions, 96 tokens fixed
    "live-mini": Workload(group_size=8, groups_per_step=4, prompt_tokens=32, length="fixed",
                          length_median=96, length_cap=96),
    # the independent model's workload, run on "one-gpu" hosts: a batch of 512 one-sample groups, no
    # prompt, lognormal lengths (median 2,000, sigma 1, capped at 16,000), max_staleness 1. Its batch
    # is part of the calibration: planners run it as it is (FIXED_BATCH), not sized to the cluster.
    "one-gpu-reasoning": Workload(group_size=1, groups_per_step=512, prompt_tokens=0, length_median=2000,
                                  length_sigma=1.0, length_cap=16_000, max_staleness=1),
}

# workloads whose batch is part of a public calibration: `seamlessflow plan` and bench/pipeline.py run
# them as they are instead of sizing the batch to the cluster's slots
FIXED_BATCH: frozenset[str] = frozenset({"one-gpu-reasoning"})


def scaled(wl: Workload, **kw) -> Workload:
    return replace(wl, **kw)
