"""Per-step trainer metrics: one log line, Prometheus, TensorBoard. Rank 0 only.

    sf_trainer_last_<key>                 gauge, the last step's value of each step metric
                                          (loss, reward_mean, adv_std, clip_frac, is_weight_max, ...)
    sf_trainer_step, sf_trainer_weight_version   gauges
    sf_trainer_steps_total                counter
    sf_trainer_trajectories_total         counter, trained trajectories
    sf_trainer_tokens_total               counter, trained (loss-mask) tokens
    sf_trainer_token_staleness_total{lag} counter, loss tokens by versions behind ("0".."7", "8+", "neg")
    sf_trainer_phase_seconds{phase}       histogram: wait (for data), gate (for the scheduler), compute, publish, checkpoint
    sf_trainer_messages_total{result}     counter: trained, duplicate (acked or held, not trained),
                                          bad (dead-lettered, then terminated), expired (incomplete group, terminated)
    sf_bus_malformed_total{service,subject} counter, deliveries and messages the trainer could not read
                                          (shared/deadletter.py)

TensorBoard gets the same step metrics as scalars (`train/*`, `time/*`, `data/*`) and
the staleness as a histogram. It knows nothing about NATS or the engine: the
service hands it a flat dict per step.
"""

from __future__ import annotations

import logging
import re

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)

PHASES = ("wait", "gate", "compute", "publish", "checkpoint")
_LAGS = [str(i) for i in range(8)] + ["8+", "neg"]
_TB_GROUPS = {"wait_s": "time", "gate_s": "time", "compute_s": "time", "publish_s": "time", "checkpoint_s": "time",
              "step_s": "time", "tokens_per_s": "time", "train_tokens_per_s": "time"}


def lag_label(lag: int) -> str:
    return "neg" if lag < 0 else (str(lag) if lag < 8 else "8+")


def staleness_summary(hist: dict[int, int]) -> dict[str, float]:
    n = sum(hist.values())
    if not n:
        return {"staleness_mean": 0.0, "staleness_max": 0.0}
    return {"staleness_mean": sum(k * c for k, c in hist.items()) / n, "staleness_max": float(max(hist))}


def format_line(step: int, version: int, m: dict[str, float], hist: dict[int, int]) -> str:
    """The one log line per step."""
    def g(k: str, fmt: str = ".4g") -> str:
        return format(m.get(k, float("nan")), fmt)

    stale = ",".join(f"{k}:{c}" for k, c in sorted(hist.items())) or "-"
    # multi-LoRA: loss tokens per role's adapter
    roles = ",".join(f"{k.removeprefix('role_tokens_')}:{int(v)}" for k, v in sorted(m.items())
                     if k.startswith("role_tokens_"))
    return (f"step {step} v{version} loss={g('loss')} reward={g('reward_mean', '.3f')}±{g('reward_std', '.3f')} "
            f"adv={g('adv_mean', '.3f')}±{g('adv_std', '.3f')} clip={g('clip_frac', '.3f')} "
            f"isw={g('is_weight_mean', '.3f')}/max {g('is_weight_max', '.3g')} trunc={g('is_truncated_frac', '.3f')} "
            f"stale={stale} trajs={int(m.get('trajectories', 0))} dropped_groups={int(m.get('groups_dropped', 0))} "
            f"tokens={int(m.get('tokens', 0))} "
            f"tok/s={g('train_tokens_per_s', '.0f')} wait={g('wait_s', '.2f')}s compute={g('compute_s', '.2f')}s "
            f"publish={g('publish_s', '.2f')}s ckpt={g('checkpoint_s', '.2f')}s" + (f" roles={roles}" if roles else ""))


class Metrics:
    def __init__(self, port: int = 0, tensorboard_dir: str = "", host: str = "127.0.0.1"):
        self.registry = CollectorRegistry()
        r = self.registry
        self._gauges: dict[str, Gauge] = {}
        self.steps = Counter("sf_trainer_steps", "Optimizer steps (global batches) trained", registry=r)
        self.trajectories = Counter("sf_trainer_trajectories", "Trajectories trained", registry=r)
        self.tokens = Counter("sf_trainer_tokens", "Loss tokens trained", registry=r)
        self.staleness = Counter("sf_trainer_token_staleness", "Loss tokens by versions behind the newest",
                                 ["lag"], registry=r)
        self.phase = Histogram("sf_trainer_phase_seconds", "Step time by phase", ["phase"], registry=r,
                               buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900))
        self.messages = Counter("sf_trainer_messages", "Deliveries by outcome", ["result"], registry=r)
        for lag in _LAGS:
            self.staleness.labels(lag)
        for p in PHASES:
            self.phase.labels(p)
        for res in ("trained", "duplicate", "bad", "expired"):
            self.messages.labels(res)
        self.port = 0
        if port:
            try:
                server, _ = start_http_server(port, addr=host, registry=r)
                self.port = server.server_port
            except OSError as e:  # a busy port must not stop training
                log.warning("Prometheus metrics off: cannot listen on port %d: %s", port, e)
        self.tb = None
        if tensorboard_dir:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(tensorboard_dir)

    def gauge(self, key: str, value: float, prefix: str = "sf_trainer_last_") -> None:
        name = prefix + re.sub(r"[^a-zA-Z0-9_]", "_", key)
        g = self._gauges.get(name)
        if g is None:
            g = self._gauges[name] = Gauge(name, f"Last step's {key}", registry=self.registry)
        g.set(value)

    def count(self, result: str, n: int = 1) -> None:
        if n:
            self.messages.labels(result).inc(n)

    def step(self, step: int, version: int, m: dict[str, float], hist: dict[int, int]) -> str:
        """Record one step everywhere; returns the log line."""
        m = {**m, **staleness_summary(hist)}
        self.steps.inc()
        self.trajectories.inc(m.get("trajectories", 0))
        self.tokens.inc(m.get("tokens", 0))
        for lag, c in hist.items():
            self.staleness.labels(lag_label(lag)).inc(c)
        for p in PHASES:
            if f"{p}_s" in m:
                self.phase.labels(p).observe(m[f"{p}_s"])
        self.gauge("step", step, "sf_trainer_")
        self.gauge("weight_version", version, "sf_trainer_")
        for k, v in m.items():
            self.gauge(k, v)
        if self.tb is not None:
            for k, v in m.items():
                self.tb.add_scalar(f"{_TB_GROUPS.get(k, 'train')}/{k}", v, step)
            self.tb.add_scalar("data/weight_version", version, step)
            if hist:
                import numpy as np

                lags = np.repeat(np.array(list(hist), dtype=np.float64), list(hist.values()))
                self.tb.add_histogram("data/staleness", lags, step)
            self.tb.flush()
        return format_line(step, version, m, hist)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
