"""The demo's report folder (DATA_DIR/report/): what a run did, as files a user can open.

    reward.png       the mean reward of every round, its rolling mean, first/last 8 rounds; below it
                     the fraction of exact answers and the policy's entropy per round, and the
                     groups dynamic sampling left out (all rewards equal)
    throughput.png   generated tokens/s over time (per round, and from worker heartbeats)
    versions.png     the weight versions that generated each round's tokens, and the newest
    timeline.png     each rollout worker's state (serving / updating / vacated ...) from its
                     sampled heartbeats and, with the tag scheduler, each host's activity
                     (train / rollout / switch / idle) from its timeline
    metrics.csv      one row per round
    trajectories.jsonl   the exported trajectories (seamlessflow/ops/export.py), when given
    summary.md       results, settings and the commands that reproduce the run

Pure files in, files out: it is given plain data (rl.Round, telemetry.Sample, the
scheduler's timeline document) and draws with matplotlib's object API (no pyplot, no
display). It knows nothing about NATS or the stack.
"""

from __future__ import annotations

import csv
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.figure import Figure

from seamlessflow.demo.rl import Round
from seamlessflow.demo.telemetry import Sample

WINDOW = 8
COLORS = {"serving": "#2ca02c", "updating": "#ff7f0e", "paused": "#bcbd22", "vacated": "#d62728",
          "sleeping": "#1f77b4", "rollout": "#2ca02c", "train": "#9467bd", "switch": "#ff7f0e", "idle": "#c7c7c7"}
HEARTBEAT_S = 1.0  # how long the last heartbeat of a worker is drawn for


@dataclass
class ReportData:
    task: str
    rounds: list[Round]
    staleness: list[int]  # per round: newest published version minus the oldest in its tokens
    newest_version: list[int]  # per round: the newest weight version when it ended
    started_at: float  # wall clock when the first round started (heartbeats are wall clock)
    samples: list[Sample] = field(default_factory=list)
    host_timeline: dict | None = None  # seamlessflow/ops/hosts.py timeline_doc
    settings: dict = field(default_factory=dict)
    commands: list[str] = field(default_factory=list)
    trajectories: Path | None = None
    notes: list[str] = field(default_factory=list)


def rolling(values: list[float], window: int = WINDOW) -> list[float]:
    return [statistics.fmean(values[max(0, i + 1 - window):i + 1]) for i in range(len(values))]


def margin(rounds: list[Round], window: int = WINDOW) -> tuple[float, float, int]:
    """(first-window mean, last-window mean, window) over every session of those rounds."""
    k = max(1, min(window, len(rounds) // 4 or 1))
    first = statistics.fmean(r for rd in rounds[:k] for r in rd.rewards)
    last = statistics.fmean(r for rd in rounds[-k:] for r in rd.rewards)
    return first, last, k


def build_report(out: Path, data: ReportData) -> list[Path]:
    """Write the folder; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    files = [_reward(out / "reward.png", data), _throughput(out / "throughput.png", data),
             _versions(out / "versions.png", data), _timeline(out / "timeline.png", data),
             _metrics(out / "metrics.csv", data)]
    if data.trajectories is not None and data.trajectories.exists():
        dst = out / "trajectories.jsonl"
        if data.trajectories.resolve() != dst.resolve():
            shutil.copyfile(data.trajectories, dst)
        files.append(dst)
    files.append(_summary(out / "summary.md", data, files))
    return files


# -- figures ----------------------------------------------------------------------------------------

def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def _reward(path: Path, d: ReportData) -> Path:
    fig = Figure(figsize=(8, 7))
    ax, low = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    x = [rd.index + 1 for rd in d.rounds]
    means = [rd.mean for rd in d.rounds]
    ax.plot(x, means, "o", ms=3, alpha=0.5, color="#1f77b4", label="round mean")
    ax.plot(x, rolling(means), "-", lw=2, color="#1f77b4", label=f"rolling mean ({WINDOW} rounds)")
    if d.rounds:
        first, last, k = margin(d.rounds)
        ax.hlines(first, x[0], x[min(k, len(x)) - 1], colors="#7f7f7f", linestyles="--", label=f"first {k}: {first:.3f}")
        ax.hlines(last, x[-min(k, len(x))], x[-1], colors="#d62728", linestyles="--", label=f"last {k}: {last:.3f}")
        ax.set_title(f"{d.task}: mean reward per round ({last - first:+.3f} first {k} -> last {k})")
    ax.set_ylabel("mean reward (0..1)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    _exact_entropy(low, d, x)
    return _save(fig, path)


def _exact_entropy(ax, d: ReportData, x: list[int]) -> None:
    """Exact answers and entropy per round (a collapse shows as entropy falling towards 0 while
    exact answers stop rising), and the uniform groups dynamic sampling leaves out."""
    exact = [rd.exact for rd in d.rounds]
    ax.plot(x, rolling(exact), "-", lw=2, color="#2ca02c", label=f"exact answers (rolling {WINDOW})")
    ax.plot(x, exact, "o", ms=2, alpha=0.4, color="#2ca02c")
    ax.plot(x, [rd.entropy for rd in d.rounds], "-", lw=1, color="#9467bd",
            label="entropy, nats/token (mean -logprob of sampled tokens)")
    groups = [rd.uniform_groups for rd in d.rounds]
    if any(groups):
        ax.bar(x, [g / max(1, max(groups)) * 0.2 for g in groups], color="#c7c7c7",
               label=f"groups with all-equal rewards (left out by dynamic sampling; {sum(groups)} in all)")
    ax.set_xlabel("round")
    ax.set_ylabel("fraction / nats")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=7)


def by_worker(samples: list[Sample]) -> dict[str, list[Sample]]:
    """worker -> its heartbeats in time order, workers in name order."""
    out: dict[str, list[Sample]] = {}
    for s in samples:
        out.setdefault(s.worker, []).append(s)
    return {w: sorted(ss, key=lambda s: s.ts) for w, ss in sorted(out.items())}


def worker_rates(samples: list[Sample], t0: float) -> list[tuple[float, float]]:
    """(seconds since t0, tokens/s summed over workers) from consecutive heartbeats' counters."""
    events: list[tuple[float, float]] = []  # (t, tokens generated in (prev, t])
    for ss in by_worker(samples).values():
        for a, b in zip(ss, ss[1:]):
            if b.ts > a.ts and b.generated_tokens >= a.generated_tokens:  # a restart resets the counter
                events.append((b.ts - t0, b.generated_tokens - a.generated_tokens))
    if not events:
        return []
    events.sort()
    bin_s = 5.0
    bins: dict[int, float] = {}
    for t, n in events:
        bins[int(t // bin_s)] = bins.get(int(t // bin_s), 0.0) + n
    return [((b + 0.5) * bin_s, n / bin_s) for b, n in sorted(bins.items())]


def _throughput(path: Path, d: ReportData) -> Path:
    fig = Figure(figsize=(8, 4))
    ax = fig.add_subplot()
    ax.step([rd.t_end for rd in d.rounds], [rd.tokens_per_s for rd in d.rounds], where="pre", color="#1f77b4",
            label="agents: completion tokens / round time")
    rates = worker_rates(d.samples, d.started_at)
    if rates:
        ax.plot([t for t, _ in rates], [r for _, r in rates], color="#ff7f0e", alpha=0.8,
                label="workers: generated tokens/s (heartbeats, 5 s bins)")
    ax.set_title("throughput over time")
    ax.set_xlabel("seconds since the first round started")
    ax.set_ylabel("tokens / s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    return _save(fig, path)


def _versions(path: Path, d: ReportData) -> Path:
    fig = Figure(figsize=(8, 4))
    ax = fig.add_subplot()
    x = [rd.index + 1 for rd in d.rounds]
    lo = [min(rd.versions) if rd.versions else 0 for rd in d.rounds]
    hi = [max(rd.versions) if rd.versions else 0 for rd in d.rounds]
    ax.vlines(x, lo, hi, colors="#1f77b4", lw=3, label="versions that generated the round's tokens")
    ax.plot(x, lo, "_", color="#1f77b4", ms=6)
    ax.plot(x, d.newest_version, "-", color="#d62728", lw=1, label="newest published version at round end")
    ax.set_title("weight version serving each round")
    ax.set_xlabel("round")
    ax.set_ylabel("policy version")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    return _save(fig, path)


def state_intervals(samples: list[Sample], t0: float) -> dict[str, list[tuple[str, float, float]]]:
    """worker -> [(state, start, end)] in seconds since t0: each heartbeat's state holds until
    the next one (the last for HEARTBEAT_S); runs of one state are merged."""
    out: dict[str, list[tuple[str, float, float]]] = {}
    for w, ss in by_worker(samples).items():
        ivs: list[tuple[str, float, float]] = []
        for a, b in zip(ss, ss[1:] + [None]):
            start, end = a.ts - t0, (b.ts if b else a.ts + HEARTBEAT_S) - t0
            if ivs and ivs[-1][0] == a.state and abs(ivs[-1][2] - start) < 1e-9:
                ivs[-1] = (a.state, ivs[-1][1], end)
            else:
                ivs.append((a.state, start, end))
        out[w] = ivs
    return out


def version_loads(samples: list[Sample], t0: float) -> dict[str, list[tuple[float, int]]]:
    """worker -> [(seconds since t0, version)] for each heartbeat that first shows a new weight version
    (not the worker's first): where each update had landed. An update takes well under the 1 s between
    heartbeats, so the "updating" state itself is mostly missed by the sampling; its result is not."""
    out: dict[str, list[tuple[float, int]]] = {}
    for w, ss in by_worker(samples).items():
        out[w] = [(b.ts - t0, b.version) for a, b in zip(ss, ss[1:]) if b.version != a.version]
    return out


LEAD_IN = 10.0  # seconds of host activity shown before the first round (not the minutes of start-up)


def clip_before(intervals: list[tuple[str, float, float]], start: float) -> list[tuple[str, float, float]]:
    """The intervals from `start` on: the scheduler's timeline begins when the stack starts, minutes
    of idle hosts (engines loading) that would squeeze the rounds into a sliver of the plot."""
    return [(state, max(a, start), b) for state, a, b in intervals if b > start]


def _timeline(path: Path, d: ReportData) -> Path:
    workers = state_intervals(d.samples, d.started_at)
    loads = version_loads(d.samples, d.started_at)
    hosts = {h: clip_before([(a, t0 - d.started_at, t1 - d.started_at) for a, t0, t1 in v["intervals"]], -LEAD_IN)
             for h, v in sorted((d.host_timeline or {}).get("hosts", {}).items())}
    rows = [(f"worker {w}", ivs) for w, ivs in workers.items()] + [(f"host {h}", ivs) for h, ivs in hosts.items()]
    fig = Figure(figsize=(9, max(3.2, 1.6 + 0.6 * len(rows))))
    ax = fig.add_subplot()
    seen: dict[str, bool] = {}
    for y, (_, ivs) in enumerate(rows):
        for state, a, b in ivs:
            ax.broken_barh([(a, max(b - a, 0.05))], (y - 0.35, 0.7), color=COLORS.get(state, "#8c564b"),
                           label=None if state in seen else state)
            seen[state] = True
    for y, (name, _) in enumerate(rows):
        ts = [t for t, _ in loads.get(name.removeprefix("worker "), [])] if name.startswith("worker ") else []
        if ts:  # a tick per new version, across the bar
            ax.plot(ts, [y] * len(ts), "|", color="black", ms=22, mew=1.2,
                    label=None if "new weights" in seen else "new weights")
            seen["new weights"] = True
    ax.set_yticks(range(len(rows)), [name for name, _ in rows])
    ax.set_ylim(-0.6, max(1, len(rows)) - 0.4)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first round started")
    title = "per-worker timeline (sampled heartbeats)"
    if hosts:
        title += f" and host activity (scheduler, policy {(d.host_timeline or {}).get('policy', '?')})"
    ax.set_title(title if rows else "no worker heartbeats were received")
    if seen:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=len(seen),
                  fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


# -- tables -----------------------------------------------------------------------------------------

METRIC_COLUMNS = ["round", "t_end_s", "seconds", "mean_reward", "rolling_mean", "min_reward", "max_reward",
                  "sessions", "tokens", "tokens_per_s", "min_version", "max_version", "newest_version",
                  "staleness", "tool_calls", "exact_frac", "entropy", "uniform_groups"]


def _metrics(path: Path, d: ReportData) -> Path:
    roll = rolling([rd.mean for rd in d.rounds])
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(METRIC_COLUMNS)
        for i, rd in enumerate(d.rounds):
            w.writerow([rd.index + 1, f"{rd.t_end:.2f}", f"{rd.seconds:.2f}", f"{rd.mean:.4f}", f"{roll[i]:.4f}",
                        f"{min(rd.rewards):.4f}", f"{max(rd.rewards):.4f}", len(rd.rewards), rd.tokens,
                        f"{rd.tokens_per_s:.2f}", min(rd.versions, default=0), max(rd.versions, default=0),
                        d.newest_version[i] if i < len(d.newest_version) else "",
                        d.staleness[i] if i < len(d.staleness) else "", rd.tool_calls, f"{rd.exact:.4f}",
                        f"{rd.entropy:.4f}", rd.uniform_groups])
    return path


def _mean_of(rounds: list[Round], attr: str) -> float:
    return statistics.fmean(getattr(rd, attr) for rd in rounds) if rounds else 0.0


def _summary(path: Path, d: ReportData, files: list[Path]) -> Path:
    lines = [f"# SeamlessFlow demo report: task `{d.task}`", "",
             f"Written {time.strftime('%Y-%m-%d %H:%M:%S')}.", ""]
    if d.rounds:
        first, last, k = margin(d.rounds)
        took = d.rounds[-1].t_end
        sessions = sum(len(rd.rewards) for rd in d.rounds)
        lines += ["## Result", "",
                  "| rounds | agent sessions | mean reward, first {k} -> last {k} rounds | change | rounds took |".format(k=k),
                  "|---|---|---|---|---|",
                  f"| {len(d.rounds)} | {sessions} | {first:.3f} -> {last:.3f} | {last - first:+.3f} | {took:.0f} s |",
                  "",
                  f"Exact answers: first {k} rounds {_mean_of(d.rounds[:k], 'exact'):.3f} -> last {k} "
                  f"{_mean_of(d.rounds[-k:], 'exact'):.3f}; entropy {_mean_of(d.rounds[:k], 'entropy'):.3f} -> "
                  f"{_mean_of(d.rounds[-k:], 'entropy'):.3f} nats/token; lowest rolling mean reward "
                  f"{min(rolling([rd.mean for rd in d.rounds])[k - 1:]):.3f}; "
                  f"{sum(rd.uniform_groups for rd in d.rounds)} groups had all-equal rewards (dynamic sampling "
                  "leaves them out of the trainer's step).",
                  "",
                  f"Policy versions: round 1 used {d.rounds[0].versions}, the last round {d.rounds[-1].versions}; "
                  f"mean staleness {statistics.fmean(d.staleness) if d.staleness else 0:.2f} versions; "
                  f"{sum(rd.tokens for rd in d.rounds)} completion tokens"
                  + (f"; {sum(rd.tool_calls for rd in d.rounds)} tool calls" if any(rd.tool_calls for rd in d.rounds)
                     else "") + ".", ""]
    lines += [f"- {n}" for n in d.notes] + ([""] if d.notes else [])
    if d.settings:
        lines += ["## Settings", "", "| setting | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in d.settings.items()] + [""]
    lines += ["## Files", ""] + [f"- [{p.name}]({p.name})" for p in files] + [""]
    lines += ["## Reproduce", "", "```bash"] + (d.commands or ["seamlessflow demo"]) + ["```", ""]
    path.write_text("\n".join(lines))
    return path
