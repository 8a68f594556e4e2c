"""`seamlessflow plan`: capacity planning on a SIMULATED cluster, before a GPU is spent.

    seamlessflow plan --hosts 64 [--calibration decode-heavy] [--workload long-tail] [--steps 200]
                      [--train-hosts N] [--out var/plan]
    seamlessflow plan --hosts 4096 --steps 1000          # the scale bound: under 60 s here
    seamlessflow plan --hosts 64 --calibration one-gpu --workload one-gpu-reasoning   # the second public one
    seamlessflow plan --hosts 64 --graces 0,30,60,90 --drain-margins 0,60 --max-reprefill 0.02

It sweeps the train/rollout split (disaggregated against seamless, short runs: every other
split of the grid, then the two next to the best, so the split it picks is a local best of the
whole grid), picks the split where seamless trains the most tokens/s, tries the lending threshold (lend_margin)
there, then the drain trade-off: seamless at every reclaim grace x drain margin
(policy.py), re-prefilled tokens against trained tokens/s. It recommends the fastest drain
setting that re-prefills under `--max-reprefill` and stays >= 0.99x disaggregated (or, when
none does, says so and keeps the fastest), runs all three policies at the split for
`--steps` steps and prints trained tokens/s, its fraction of the physical limit, idle,
staleness and re-prefill for each. It writes the sweep as a PNG and the results as JSON
under --out.

Every figure comes from services/scheduler/sim/simulator.py, which drives the scheduler's own policy
module in virtual time; none is measured on hardware. Large clusters are simulated with
session replicas and host groups (see sim.py); the table says which were used.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from services.scheduler.sim import Cluster, simulate
from services.scheduler.sim.result import Result
from services.scheduler.sim.workload import (
    CALIBRATIONS,
    FIXED_BATCH,
    WORKLOADS,
    Calibration,
    Workload,
)

POLICIES = ("colocated", "disaggregated", "seamless")
DEFAULT_MARGIN = 1.5  # the scheduler's default lend_margin (SF_SCHEDULER_LEND_MARGIN)
MARGINS = (1.0, DEFAULT_MARGIN, 3.0)  # lend_margin values tried
GRACES = (0.0, 30.0, 60.0, 90.0)  # reclaim_grace_s tried (SF_SCHEDULER_RECLAIM_GRACE_S; 0 = the default)
DRAIN_MARGINS = (0.0, 60.0)  # drain_margin_s tried (SF_SCHEDULER_DRAIN_MARGIN_S)
MAX_REPREFILL = 0.02  # re-prefilled / generated tokens the recommended drain setting stays under
MAX_SIM_HOSTS = 128  # above this, hosts are simulated in identical groups
MAX_SIM_SESSIONS = 8192  # above this, each simulated session stands for several


def sized(wl: Workload, cal: Calibration, hosts: int, fill: float = 1.0) -> Workload:
    """The workload with a batch that can keep `hosts` busy: batch ~ fill x all slots."""
    groups = max(1, round(hosts * cal.max_seqs * fill / wl.group_size))
    return replace(wl, groups_per_step=groups)


def scale_factors(hosts: int, train_hosts: int, wl: Workload) -> tuple[int, int]:
    """(replicas, host_group) that keep the simulation small; (1, 1) is exact."""
    m = 1
    while hosts // m > MAX_SIM_HOSTS and hosts % (2 * m) == 0 and train_hosts % (2 * m) == 0:
        m *= 2
    w = 1
    sessions = (max(wl.max_staleness, 0) + 1) * wl.batch_samples
    while sessions // w > MAX_SIM_SESSIONS and wl.groups_per_step % (2 * w) == 0:
        w *= 2
    return w, m


def run(policy: str, hosts: int, train_hosts: int, cal: Calibration, wl: Workload, steps: int,
        exact: bool = False, **options) -> Result:
    """One policy on one cluster. colocated is verl-style synchronous: max_staleness 0, every host trains.
    `options` are the simulator's (sim.Options: seed, lend_margin, reclaim_grace_s, drain_margin_s,
    timeline, progress, dt, ...); large clusters are simulated in replicas and host groups unless `exact`."""
    if policy == "colocated":
        wl = replace(wl, max_staleness=0)
    w, m = (1, 1) if exact else scale_factors(hosts, train_hosts, wl)
    if options.get("dt") is None:  # the control tick, as a fraction of a mean turn (control events cut ticks
        # exactly); on large clusters a tenth of a turn: against a twentieth, trained tok/s moved by at most
        # 1.2% (4,096 hosts, 100 steps, all three policies) and the run takes half the time
        turn_s = wl.mean_length() * cal.step_s(cal.max_seqs)
        options["dt"] = max(0.01, turn_s / (10 if hosts > 256 else 100))
    return simulate(Cluster.uniform(hosts, train_hosts), cal, wl, policy, steps=steps, replicas=w, host_group=m,
                    **options)


def splits(hosts: int, points: int = 12) -> list[int]:
    """Train-pool sizes to sweep: every split on small clusters, an even grid on large ones."""
    if hosts - 1 <= points:
        return list(range(1, hosts))
    _, m = scale_factors(hosts, 0, WORKLOADS["long-tail"])
    step = max(m, (hosts // points) // m * m)
    return list(range(step, hosts, step))


@dataclass(frozen=True)
class Search:
    """What `plan` tries: the trial runs' length and the final runs' (trainer steps), a fixed split
    (None: sweep it), the lending thresholds, and the drain settings (reclaim grace x drain margin)
    with the re-prefill budget the recommended one stays under."""

    steps: int = 200
    sweep_steps: int = 20
    train_hosts: int | None = None
    margins: tuple[float, ...] = MARGINS
    graces: tuple[float, ...] = GRACES
    drain_margins: tuple[float, ...] = DRAIN_MARGINS
    max_reprefill: float = MAX_REPREFILL


@dataclass(frozen=True)
class Trial:
    """One simulated run of a plan, as a worker process makes it (`label`: its progress bar line)."""

    policy: str
    hosts: int
    train_hosts: int
    cal: Calibration
    wl: Workload
    steps: int
    label: str
    lend_margin: float = DEFAULT_MARGIN
    reclaim_grace_s: float = 0.0
    drain_margin_s: float = 0.0


@dataclass
class Plan:
    hosts: int
    calibration: str
    workload: str
    split: int
    lend_margin: float
    sweep: list[dict]
    margins: list[dict]
    results: list[dict]
    seconds: float
    reclaim_grace_s: float = 0.0
    drain_margin_s: float = 0.0
    drains: list[dict] | None = None  # the drain trade-off: one row per (grace, drain margin)
    drain_note: str = ""  # why this drain setting


def pick_drain(rows: list[dict], disaggregated: float, max_reprefill: float = MAX_REPREFILL) -> tuple[dict, str]:
    """The drain setting to recommend from the trade-off rows (each with reclaim_grace_s,
    drain_margin_s, trained_tok_s, reprefill_fraction): the fastest that re-prefills under
    `max_reprefill` and trains >= 0.99x disaggregated; if none, the fastest, and why."""
    ok = [r for r in rows if r["reprefill_fraction"] < max_reprefill and r["trained_tok_s"] >= 0.99 * disaggregated]
    if ok:
        best = max(ok, key=lambda r: r["trained_tok_s"])
        return best, f"fastest under {max_reprefill:.0%} re-prefill and >= 0.99x disaggregated"
    best = max(rows, key=lambda r: r["trained_tok_s"])
    low = min(rows, key=lambda r: r["reprefill_fraction"])
    why = (f"no setting tried re-prefills under {max_reprefill:.0%} at >= 0.99x disaggregated (least: "
           f"{low['reprefill_fraction']:.2%} at {low['trained_tok_s'] / disaggregated:.3f}x); the fastest is kept")
    return best, why


def plan(hosts: int, cal: Calibration, wl: Workload, search: Search = Search(), progress=None,
         workload_name: str = "", workers: int = 0) -> Plan:
    """Sweep the split (every other point, then the neighbours of the best), try the lending
    thresholds at the best split, then the drain settings (reclaim grace x drain margin) at the
    winning threshold, then run the three policies there for `search.steps` steps.

    Runs that do not depend on each other go to `workers` processes (0 = one per core), and no
    run is made twice or in vain: colocated ignores the split (every host trains), so it starts
    first; a trial whose setting an earlier stage already ran (the default threshold in the
    sweep, no drain at the winning threshold) reuses that row; seamless runs its `steps` once,
    with the winning settings. The progress bar's total is `jobs(...)`: work skipped ticks too."""
    t0 = time.perf_counter()
    steps, sweep_steps, margins, max_reprefill = search.steps, search.sweep_steps, search.margins, search.max_reprefill
    grid = [search.train_hosts] if search.train_hosts else splits(hosts)
    tick = progress or (lambda *a, **k: None)
    with _Pool(workers, tick, hosts, cal, wl) as pool:
        # 1. colocated, if the split does not change its run (the same host groups at every split)
        w_m = {scale_factors(hosts, t, wl) for t in grid}
        static = {"colocated": pool.submit("colocated", grid[0], steps, "colocated")} \
            if len(w_m) == 1 else {}
        # 2. the split: every other point of the grid, then the unswept neighbours of the best
        rows: dict[tuple[int, str], dict] = {}
        _sweep(pool, rows, grid[::2], sweep_steps)
        near = _neighbours(grid, max((t for t, pol in rows if pol == "seamless"),
                                     key=lambda t: rows[t, "seamless"]["trained_tok_s"]))
        _sweep(pool, rows, [t for t in near if (t, "seamless") not in rows], sweep_steps)
        tick("sweep", 2 * (len(grid) - len(rows) // 2))  # the points never run
        swept = sorted({t for t, _ in rows})
        sweep = [{"train_hosts": t, **{pol: rows[t, pol]["trained_tok_s"] for pol in ("disaggregated", "seamless")}}
                 for t in swept]
        best = max(sweep, key=lambda r: r["seamless"])["train_hosts"]
        if not static:
            static["colocated"] = pool.submit("colocated", best, steps, "colocated")
        # 3. the lending threshold at that split (the sweep ran the default one)
        trials = {mg: rows[best, "seamless"] if mg == DEFAULT_MARGIN else
                  pool.submit("seamless", best, sweep_steps, "margin", mg) for mg in margins}
        tick("margin", sum(mg == DEFAULT_MARGIN for mg in margins))
        by_margin = {mg: pool.result(f) for mg, f in trials.items()}
        tried = [{"lend_margin": mg, "seamless": r["trained_tok_s"]} for mg, r in by_margin.items()]
        margin = max(tried, key=lambda r: r["seamless"])["lend_margin"]
        # 4. the drain trade-off at that threshold: re-prefill against trained tokens/s (short runs;
        # no grace and no margin is the threshold trial's run)
        settings = [(g, dm) for g in search.graces for dm in search.drain_margins]
        trials = {gd: by_margin[margin] if gd == (0.0, 0.0) else
                  pool.submit("seamless", best, sweep_steps, "drain", margin, *gd) for gd in settings}
        tick("drain", sum(gd == (0.0, 0.0) for gd in settings))
        disagg = rows[best, "disaggregated"]["trained_tok_s"]
        drains = [{"reclaim_grace_s": g, "drain_margin_s": dm, **_pick(pool.result(f))} for (g, dm), f in trials.items()]
        chosen, note = pick_drain(drains, disagg, max_reprefill) if drains else ({"reclaim_grace_s": 0.0,
                                                                                  "drain_margin_s": 0.0}, "")
        grace, drain = chosen["reclaim_grace_s"], chosen["drain_margin_s"]
        # 5. the three policies for `steps` steps; seamless, the last to be known, first
        last = pool.submit("seamless", best, steps, "seamless", margin, grace, drain)
        static["disaggregated"] = pool.submit("disaggregated", best, steps, "disaggregated")
        final = {pol: pool.result(f) for pol, f in static.items()} | {"seamless": pool.result(last)}
    results = [final[pol] for pol in POLICIES]
    reprefill = final["seamless"]["reprefill_fraction"]
    if drains and reprefill >= max_reprefill:  # short trials are noisy: say so rather than hide it
        note += (f"; the {steps}-step run re-prefilled {reprefill:.2%}, over the budget: try more --sweep-steps "
                 f"or a longer grace")
    return Plan(hosts, cal.name, workload_name, best, margin, sweep, tried, results, time.perf_counter() - t0,
                grace, drain, drains, note)


def jobs(grid: list[int], margins, graces, drain_margins, steps: int) -> int:
    """The progress bar's total for `plan`: a tick per trial, a tick per step of each final run."""
    return 2 * len(grid) + len(margins) + len(graces) * len(drain_margins) + 3 * steps


def _sweep(pool: _Pool, rows: dict, points: list[int], steps: int) -> None:
    """Disaggregated and seamless at each split in `points`, into rows[(split, policy)]."""
    runs = {(t, pol): pool.submit(pol, t, steps, "sweep")
            for t in points for pol in ("disaggregated", "seamless")}
    rows.update({k: pool.result(f) for k, f in runs.items()})


def _neighbours(grid: list[int], t: int) -> list[int]:
    """The splits next to t on the grid."""
    i = grid.index(t)
    return grid[max(0, i - 1): i + 2]


def _pick(row: dict) -> dict:
    return {k: row[k] for k in ("trained_tok_s", "reprefill_fraction", "trainer_wait", "idle")}


_progress_queue = None  # a worker's end of the progress queue (set by _Pool's initializer)


def _init_worker(queue) -> None:
    global _progress_queue
    _progress_queue = queue


def _run_row(t: Trial) -> dict:
    """One simulation in a worker process; its steps go to the parent's progress bar."""
    done = [0]

    def on_step(k: int) -> None:
        if k - done[0] >= 10 or k == t.steps:
            _progress_queue.put((t.label, k - done[0]))
            done[0] = k
    long_run = t.label in POLICIES
    row = run(t.policy, t.hosts, t.train_hosts, t.cal, t.wl, t.steps, lend_margin=t.lend_margin,
              progress=on_step if long_run else None, reclaim_grace_s=t.reclaim_grace_s,
              drain_margin_s=t.drain_margin_s).row()
    if not long_run:
        _progress_queue.put((t.label, 1))
    return row


class _Pool:
    """A process pool for one plan's trials (on `hosts` hosts, `cal`, `wl`), whose workers report
    progress on a queue that `result` drains while it waits, so the bar moves during long runs.
    workers <= 1 runs everything in process."""

    def __init__(self, workers: int, tick, hosts: int, cal: Calibration, wl: Workload) -> None:
        import multiprocessing as mp
        import os

        self.workers = workers or len(os.sched_getaffinity(0))
        self.tick = tick
        self.hosts, self.cal, self.wl = hosts, cal, wl
        ctx = mp.get_context("fork")
        self.queue = ctx.SimpleQueue()
        self.ex = None
        if self.workers > 1:
            from concurrent.futures import ProcessPoolExecutor

            self.ex = ProcessPoolExecutor(self.workers, mp_context=ctx, initializer=_init_worker,
                                          initargs=(self.queue,))
        else:
            _init_worker(self.queue)

    def __enter__(self) -> _Pool:
        return self

    def __exit__(self, *exc) -> None:
        if self.ex is not None:
            self.ex.shutdown(wait=True, cancel_futures=True)

    def submit(self, policy: str, train_hosts: int, steps: int, label: str, lend_margin: float = DEFAULT_MARGIN,
               reclaim_grace_s: float = 0.0, drain_margin_s: float = 0.0):
        trial = Trial(policy, self.hosts, train_hosts, self.cal, self.wl, steps, label, lend_margin, reclaim_grace_s,
                      drain_margin_s)
        if self.ex is None:
            row = _run_row(trial)
            self._drain()
            return row
        return self.ex.submit(_run_row, trial)

    def result(self, future) -> dict:
        if isinstance(future, dict):
            return future
        from concurrent.futures import wait

        while not wait([future], timeout=0.2).done:
            self._drain()
        self._drain()
        return future.result()

    def _drain(self) -> None:
        while not self.queue.empty():
            self.tick(*self.queue.get())


def table(p: Plan) -> str:
    head = (f"SIMULATED plan: {p.hosts} hosts ({p.calibration}, workload {p.workload}); recommended split "
            f"{p.split} train / {p.hosts - p.split} rollout, lend_margin {p.lend_margin:g}, reclaim_grace_s "
            f"{p.reclaim_grace_s:g}, drain_margin_s {p.drain_margin_s:g}; {p.seconds:.1f} s")
    lines = [head, "", ("| policy | trained tok/s | of physical limit | idle | max host idle | staleness mean / max | "
                  "trainer wait | lends / reclaims | re-prefilled | lent-idle host-s (of lent) |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in p.results:  # lent-idle: a host lent and given no turn, a defect the lend verdict should prevent
        lines.append(f"| {r['policy']} | {r['trained_tok_s']:,} | {r['limit_fraction']:.1%} | {r['idle']:.1%} | "
                     f"{r['idle_host_max']:.1%} | {r['staleness_mean']:.2f} / {r['staleness_max']} | "
                     f"{r['trainer_wait']:.1%} | {r['lends']} / {r['reclaims']} | {r['reprefill_fraction']:.2%} | "
                     f"{r.get('lent_idle_s', 0):,.0f} ({r.get('lent_s', 0):,.0f}) |")
    if p.drains:
        dis = next(r["disaggregated"] for r in p.sweep if r["train_hosts"] == p.split)
        lines += ["", f"Drain trade-off (seamless at split {p.split}, short runs): {p.drain_note}", "",
                  "| reclaim grace s | drain margin s | trained tok/s | / disaggregated | re-prefilled | trainer wait |",
                  "|---|---|---|---|---|---|"]
        for r in p.drains:
            mark = " **(recommended)**" if (r["reclaim_grace_s"], r["drain_margin_s"]) == (p.reclaim_grace_s,
                                                                                         p.drain_margin_s) else ""
            lines.append(f"| {r['reclaim_grace_s']:g}{mark} | {r['drain_margin_s']:g} | {r['trained_tok_s']:,} | "
                         f"{r['trained_tok_s'] / dis:.3f} | {r['reprefill_fraction']:.2%} | {r['trainer_wait']:.1%} |")
    return "\n".join(lines)


def plot_sweep(sweep: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["train_hosts"] for r in sweep]
    fig, ax = plt.subplots(figsize=(7, 4))
    for pol in ("disaggregated", "seamless"):
        ax.plot(x, [r[pol] for r in sweep], marker="o", label=pol)
    ax.set_xlabel("train hosts (the rest roll out)")
    ax.set_ylabel("trained tokens/s (SIMULATED)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cmd_plan(a) -> None:
    from rich.progress import Progress

    cal = CALIBRATIONS[a.calibration]
    wl = WORKLOADS[a.workload]
    if a.workload not in FIXED_BATCH:  # a public calibration's batch is part of it
        wl = sized(wl, cal, a.hosts)
    grid = [a.train_hosts] if a.train_hosts else splits(a.hosts)
    graces, drains = _floats(a.graces), _floats(a.drain_margins)
    total = jobs(grid, MARGINS, graces, drains, a.steps)
    search = Search(a.steps, a.sweep_steps, a.train_hosts, graces=graces, drain_margins=drains,
                    max_reprefill=a.max_reprefill)
    with Progress() as bar:
        task = bar.add_task(f"simulating {a.hosts} hosts", total=total)
        p = plan(a.hosts, cal, wl, search,
                 progress=lambda what, k: bar.update(task, advance=k, description=f"simulating: {what}"),
                 workload_name=a.workload)
    print(table(p))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    plot_sweep(p.sweep, out / "sweep.png", f"{a.hosts} hosts, {cal.name}, {a.workload} (SIMULATED)")
    (out / "plan.json").write_text(json.dumps(asdict(p), indent=1))
    print(f"\nsweep: {out / 'sweep.png'}   results: {out / 'plan.json'}")


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="capacity planner: expected throughput, idle and staleness per policy on a "
                                    "SIMULATED cluster; recommends the split and the lending threshold")
    p.add_argument("--hosts", type=int, default=64, help="8-accelerator hosts, all tagged {train, rollout}")
    p.add_argument("--train-hosts", type=int, default=0, help="fix the train pool (default: sweep and recommend)")
    p.add_argument("--calibration", default="decode-heavy", choices=sorted(CALIBRATIONS))
    p.add_argument("--workload", default="long-tail", choices=sorted(WORKLOADS))
    p.add_argument("--steps", type=int, default=200, help="trainer steps per policy at the recommended split")
    p.add_argument("--sweep-steps", type=int, default=20, help="trainer steps per point of the split sweep")
    p.add_argument("--graces", default=",".join(f"{g:g}" for g in GRACES),
                   help="reclaim_grace_s values to try (seconds a lent host drains before its reclaim)")
    p.add_argument("--drain-margins", default=",".join(f"{d:g}" for d in DRAIN_MARGINS),
                   help="drain_margin_s values to try (seconds before the predicted reclaim a lent host stops taking turns)")
    p.add_argument("--max-reprefill", type=float, default=MAX_REPREFILL,
                   help="re-prefilled / generated tokens the recommended drain setting must stay under")
    p.add_argument("--out", default="var/plan")
    p.set_defaults(fn=cmd_plan)


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())
