"""What a SIMULATED run measured (services/scheduler/sim/simulator.py): totals while it runs, and the
derived figures every report prints (bench/pipeline.py, seamlessflow plan).

The physical limit is the trained tokens/s of the same cluster if every host were busy
all the time at full efficiency: decoding at its full batch K, prefilling each prompt once,
training, with no switch, no weight sync, no idle and no re-prefill.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

ACTS = ("train", "rollout", "switch", "idle")


@dataclass
class Totals:
    n_hosts: int
    generated: float = 0.0  # tokens decoded
    prefilled: float = 0.0  # tokens prefilled (first time and again)
    reprefilled: float = 0.0  # context tokens prefilled again after a vacate
    migrated: int = 0  # sequences vacated mid-turn
    trained_tokens: float = 0.0
    trained_generated: float = 0.0
    trained_samples: int = 0
    samples_done: int = 0
    staleness_sum: float = 0.0
    staleness_max: int = 0
    trainer_wait_s: float = 0.0
    lends: int = 0
    reclaims: int = 0
    drains: int = 0  # rollout-to-rollout assignments: a drain (reclaim_grace_s) or lent_until moved (drain_margin_s)
    decide_calls: int = 0
    control_turns: int = 0  # simulated turns that passed through the control plane
    control_wait_s: float = 0.0  # seconds queued turns waited for the control plane (Options.control_s_per_turn)
    lent_s: float = 0.0  # host-seconds pool hosts were lent (rollout mode, applied; seamless)
    lent_idle_s: float = 0.0  # of which running nothing: a lent host given no work (a defect)
    host_time: np.ndarray = field(default=None)  # [host, activity] seconds
    timeline: list = field(default_factory=list)  # (host, start, end, activity)

    def __post_init__(self):
        if self.host_time is None:
            self.host_time = np.zeros((self.n_hosts, len(ACTS)))


@dataclass
class Result:
    policy: str
    hosts: int
    train_hosts: int
    steps: int
    wall_s: float
    trained_tokens_per_s: float
    limit_tokens_per_s: float
    idle_fraction: float
    idle_per_host: list[float]
    switch_fraction: float
    staleness_mean: float
    staleness_max: int
    trainer_wait_fraction: float
    lends: int
    reclaims: int
    drains: int
    switch_s: float
    generated: float
    reprefilled: float
    reprefill_fraction: float
    unaccounted_generated: float  # generated - trained - in flight: 0 when tokens are conserved
    decide_calls: int
    host_time: np.ndarray
    timeline: list
    control_wait_s: float = 0.0  # per turn: seconds a queued turn waited for the control plane, mean
    lent_s: float = 0.0  # host-seconds pool hosts were lent (seamless)
    lent_idle_s: float = 0.0  # host-seconds lent pool hosts ran nothing: lent and given no work (a defect)

    @property
    def limit_fraction(self) -> float:
        return self.trained_tokens_per_s / self.limit_tokens_per_s if self.limit_tokens_per_s else 0.0

    @classmethod
    def build(cls, sim, in_flight_generated: float) -> Result:
        t, cal, wl = sim.tot, sim.cal, sim.wl
        wall = max(sim.t, 1e-9)
        ht = t.host_time
        per_host = ht.sum(axis=1)
        idle = ht[:, ACTS.index("idle")] / np.maximum(per_host, 1e-12)
        # host-seconds the trained samples need at full efficiency, over the whole capacity
        first_prefill = (wl.prompt_tokens + wl.tool_tokens * (wl.turns - 1)) * t.trained_samples
        need = (t.trained_generated * cal.step_s(cal.max_seqs) / cal.max_seqs
                + first_prefill * cal.prefill_s_per_token + t.trained_tokens * cal.train_s_per_token)
        limit = t.trained_tokens * float(sim.cap.sum()) * sim.m / need if need else 0.0
        return cls(
            policy=sim.policy, hosts=len(sim.cap) * sim.m, train_hosts=sim.train_hosts * sim.m, steps=sim.step, wall_s=wall,
            trained_tokens_per_s=t.trained_tokens / wall, limit_tokens_per_s=limit,
            idle_fraction=float(ht[:, ACTS.index("idle")].sum() / max(ht.sum(), 1e-12)),
            idle_per_host=idle.tolist(),
            switch_fraction=float(ht[:, ACTS.index("switch")].sum() / max(ht.sum(), 1e-12)),
            staleness_mean=t.staleness_sum / t.trained_samples if t.trained_samples else 0.0,
            staleness_max=t.staleness_max, trainer_wait_fraction=t.trainer_wait_s / wall,
            lends=t.lends * sim.m, reclaims=t.reclaims * sim.m, drains=t.drains * sim.m, switch_s=float(ht[:, ACTS.index("switch")].sum()) * sim.m,
            generated=t.generated, reprefilled=t.reprefilled,
            reprefill_fraction=t.reprefilled / t.generated if t.generated else 0.0,
            unaccounted_generated=t.generated - t.trained_generated - in_flight_generated,
            decide_calls=t.decide_calls, host_time=ht, timeline=t.timeline,
            control_wait_s=t.control_wait_s / max(t.control_turns, 1), lent_s=t.lent_s, lent_idle_s=t.lent_idle_s)

    def row(self) -> dict:
        return {"policy": self.policy, "hosts": self.hosts, "train_hosts": self.train_hosts, "steps": self.steps,
                "wall_s": round(self.wall_s, 1), "trained_tok_s": round(self.trained_tokens_per_s),
                "limit_fraction": round(self.limit_fraction, 3), "idle": round(self.idle_fraction, 4),
                "idle_host_max": round(max(self.idle_per_host), 4), "switch": round(self.switch_fraction, 4),
                "staleness_mean": round(self.staleness_mean, 2), "staleness_max": self.staleness_max,
                "trainer_wait": round(self.trainer_wait_fraction, 3), "lends": self.lends,
                "reclaims": self.reclaims, "drains": self.drains, "switch_s": round(self.switch_s, 1),
                "reprefill_fraction": round(self.reprefill_fraction, 4), "reprefilled": round(self.reprefilled),
                "lent_s": round(self.lent_s, 1), "lent_idle_s": round(self.lent_idle_s, 1)}
