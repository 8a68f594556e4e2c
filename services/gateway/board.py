"""The status page's memory (pure): what this gateway saw over the last minutes, for /ui.

- every rollout worker's activity over time, from its WorkerStatus heartbeats, as intervals.
  A serving worker with nothing running is `idle`: a bubble, drawn as one;
- the trainer's state over time (from TrainerStatus heartbeats) and its latest report;
- the gateway's own turns/s and tokens/s, from samples of its Prometheus counters;
- the rewards agents reported through /v1/sessions, and the trainer's reward and staleness
  gauges, as short series.

It knows nothing about NATS, HTTP or Prometheus: service.py and ui.py feed it, with the
wall clock (`time.time()`, the clock the scheduler's host timelines use too).
"""

from __future__ import annotations

from collections import deque

from shared.messages.rollout import WorkerStatus
from shared.messages.scheduler import TrainerStatus

HORIZON = 900.0  # seconds of history kept
GAP = 5.0  # a row silent this long has a gap: the next report starts a new interval
SAMPLE_EVERY = 2.0  # seconds between two points of the series


def worker_activity(s: WorkerStatus) -> str:
    """A worker's state in the timeline's words: rollout | idle | update | paused | vacated | sleeping."""
    if s.state == "serving":
        return "rollout" if s.running > 0 else "idle"
    return {"updating": "update"}.get(s.state, s.state)


def trainer_activity(s: TrainerStatus) -> str:
    """waiting for data is a bubble (idle); ready waits at the scheduler's gate (switch)."""
    return {"computing": "train", "publishing": "publish", "ready": "switch", "waiting": "idle"}.get(s.state, "stopped")


class Timeline:
    """Per row, intervals [activity, t_start, t_end], merged while the activity holds."""

    def __init__(self, horizon: float = HORIZON, gap: float = GAP) -> None:
        self.horizon, self.gap = horizon, gap
        self.rows: dict[str, deque[list]] = {}

    def observe(self, row: str, activity: str, now: float) -> None:
        d = self.rows.setdefault(row, deque())
        last = d[-1] if d else None
        if last is not None and now - last[2] <= self.gap:
            last[2] = max(last[2], now)  # contiguous: the previous interval lasts until this report
            if last[0] == activity:
                return
        d.append([activity, now, now])
        while d and d[0][2] < now - self.horizon:
            d.popleft()

    def window(self, row: str, since: float) -> list[list]:
        return [[a, max(t0, since), t1] for a, t0, t1 in self.rows.get(row, ()) if t1 >= since]


class Rate:
    """Per-second rate of a counter over the last `window` seconds, from (time, total) samples."""

    def __init__(self, window: float = 10.0) -> None:
        self.window = window
        self.samples: deque[tuple[float, float]] = deque()

    def add(self, now: float, total: float) -> None:
        self.samples.append((now, total))
        while len(self.samples) > 2 and self.samples[1][0] <= now - self.window:
            self.samples.popleft()

    def per_second(self) -> float:
        if len(self.samples) < 2:
            return 0.0
        (t0, v0), (t1, v1) = self.samples[0], self.samples[-1]
        return max(0.0, v1 - v0) / (t1 - t0) if t1 > t0 else 0.0


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


class Board:
    def __init__(self, horizon: float = HORIZON) -> None:
        self.horizon = horizon
        self.workers = Timeline(horizon)
        self.trainer_rows = Timeline(horizon)
        self.trainer: TrainerStatus | None = None
        self.trainer_seen = 0.0
        self.trainer_metrics: dict[str, object] = {}  # sf_trainer_* gauges, last scrape (ui.py)
        self.trainer_metrics_error = ""
        self.scraped_at = 0.0
        self.turns, self.tokens = Rate(), Rate()
        self.rewards: deque[tuple[float, float]] = deque(maxlen=1000)  # (time, reward) agents reported
        self.series: deque[dict] = deque(maxlen=int(horizon / SAMPLE_EVERY) + 1)

    # 1. what the gateway hears -------------------------------------------------------------------

    def worker(self, s: WorkerStatus, now: float) -> None:
        self.workers.observe(s.worker_id, worker_activity(s), now)

    def trainer_status(self, s: TrainerStatus, now: float) -> None:
        self.trainer, self.trainer_seen = s, now
        self.trainer_rows.observe("trainer", trainer_activity(s), now)

    def reward(self, value: float, now: float) -> None:
        self.rewards.append((now, value))

    def counters(self, now: float, turns_total: float, tokens_total: float) -> None:
        """Samples of the gateway's turn and token counters; a series point every SAMPLE_EVERY s."""
        self.turns.add(now, turns_total)
        self.tokens.add(now, tokens_total)
        if self.series and now - self.series[-1]["t"] < SAMPLE_EVERY:
            return
        self.series.append({"t": round(now, 2), "turns_per_s": round(self.turns.per_second(), 3),
                            "tokens_per_s": round(self.tokens.per_second(), 1),
                            "reward": self.reward_mean(now),
                            "trainer_reward": self.trainer_metrics.get("reward_mean"),
                            "staleness": self.trainer_metrics.get("staleness_mean")})
        while self.series and self.series[0]["t"] < now - self.horizon:
            self.series.popleft()

    def reward_mean(self, now: float, window: float = 60.0) -> float | None:
        m = _mean([r for t, r in self.rewards if t >= now - window])
        return None if m is None else round(m, 4)

    # 2. what the page gets ----------------------------------------------------------------------

    def snapshot(self, now: float, window: float, workers: list[WorkerStatus], stale_after: float) -> dict:
        """The page's JSON, less the scheduler's hosts (service.py asks the scheduler for those)."""
        since = now - window
        trainer = None
        if self.trainer is not None:
            t = self.trainer
            trainer = {"state": t.state, "step": t.step, "version": t.version, "ready_groups": t.ready_groups,
                       "open_groups": t.open_groups, "buffered_samples": t.buffered_samples,
                       "groups_per_step": t.groups_per_step, "group_size": t.group_size,
                       "last_wait_s": t.last_wait_s, "last_compute_s": t.last_compute_s, "hosts": t.hosts,
                       "age_s": round(now - self.trainer_seen, 2), "alive": now - self.trainer_seen <= stale_after}
        newest = max([w.version for w in workers] + ([self.trainer.version] if self.trainer else []), default=None)
        versions: dict[str, list[str]] = {}
        for w in workers:
            versions.setdefault(str(w.version), []).append(w.worker_id)
        rows = sorted(set(self.workers.rows) | {w.worker_id for w in workers})
        return {
            "now": now, "window": window, "newest_version": newest,
            "workers": [{"id": w.worker_id, "host": w.host, "state": w.state, "activity": worker_activity(w),
                         "version": w.version, "lag": None if newest is None else newest - w.version,
                         "running": w.running, "capacity": w.capacity, "generated_tokens": w.generated_tokens,
                         "lent_until": w.lent_until, "age_s": round(now - w.ts, 2)} for w in workers],
            "worker_timeline": {r: self.workers.window(r, since) for r in rows if self.workers.window(r, since)},
            "trainer": trainer,
            "trainer_timeline": self.trainer_rows.window("trainer", since),
            "trainer_metrics": self.trainer_metrics, "trainer_metrics_error": self.trainer_metrics_error,
            "versions": versions,
            "turns_per_s": round(self.turns.per_second(), 3), "tokens_per_s": round(self.tokens.per_second(), 1),
            "reward_mean_60s": self.reward_mean(now), "rewards_60s": sum(1 for t, _ in self.rewards if t >= now - 60),
            "series": [p for p in self.series if p["t"] >= since],
        }
