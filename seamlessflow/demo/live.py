"""The demo's live view: round, mean reward with a sparkline, tokens/s, staleness, the weight
version, each rollout worker's state and, with the tag scheduler, each host's mode.

On a terminal it is a `rich` Live panel redrawn a few times a second; when stdout is not a
terminal (CI logs, a pipe) it prints one plain line per round instead. It is fed plain data
(rl.Round, WorkerStatus, HostInfo) and knows nothing about NATS or the stack.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from seamlessflow.demo.rl import Round
from shared.messages import WorkerStatus
from shared.messages.scheduler import HostInfo

BLOCKS = "▁▂▃▄▅▆▇█"
WINDOW = 8  # rounds in the rolling mean (the README's first-8 / last-8 measure)
STATE_STYLE = {"serving": "green", "updating": "yellow", "paused": "yellow", "vacated": "red", "sleeping": "blue",
               "rollout": "green", "train": "magenta", "switch": "yellow", "idle": "dim"}


def sparkline(values: list[float], lo: float = 0.0, hi: float = 1.0, width: int = 40) -> str:
    """The last `width` values on a fixed scale (rewards are 0..1, so heights compare across runs)."""
    out = []
    for v in values[-width:]:
        x = 0.0 if hi <= lo else (min(max(v, lo), hi) - lo) / (hi - lo)
        out.append(BLOCKS[min(len(BLOCKS) - 1, int(x * len(BLOCKS)))])
    return "".join(out)


@dataclass
class RoundView:
    round: Round
    staleness: int  # newest published version minus the oldest version in the round's tokens
    version: int  # newest weight version when the round ended


class DemoView:
    def __init__(self, task: str, rounds: int, console: Console | None = None, title: str = "SeamlessFlow demo"):
        self.console = console or Console()
        self.task, self.total, self.title = task, rounds, title
        self.rows: list[RoundView] = []
        self.workers: list[WorkerStatus] = []
        self.hosts: list[HostInfo] = []
        self.policy = ""
        self.version = 0
        self.started = time.monotonic()
        self._live: Live | None = None

    @property
    def interactive(self) -> bool:
        return self.console.is_terminal

    # -- feeding ------------------------------------------------------------------------------------

    def add_round(self, rd: Round, staleness: int, version: int) -> None:
        self.rows.append(RoundView(rd, staleness, version))
        self.version = max(self.version, version)
        if not self.interactive:
            self.console.print(self.plain_line(self.rows[-1]), highlight=False, soft_wrap=True)

    def note(self, message: str) -> None:
        """A log line: above the live panel, or a plain line."""
        self.console.print(message, highlight=False, markup=False, soft_wrap=True)

    # -- drawing ------------------------------------------------------------------------------------

    def means(self) -> list[float]:
        return [r.round.mean for r in self.rows]

    def plain_line(self, rv: RoundView) -> str:
        rd = rv.round
        rolling = statistics.fmean(self.means()[-WINDOW:])
        workers = " ".join(f"{w.worker_id}={w.state}@v{w.version}" for w in self.workers)
        hosts = " ".join(f"{h.host}={h.activity or h.mode}" for h in self.hosts)
        return (f"round {rd.index + 1:3d}/{self.total}: mean reward {rd.mean:.3f} (rolling {rolling:.3f})  "
                f"{rd.tokens_per_s:6.1f} tok/s  staleness {rv.staleness}  version {rv.version}  "
                f"policy versions {rd.versions}  {rd.seconds:.1f}s" + (f"  {workers}" if workers else "")
                + (f"  {hosts}" if hosts else ""))

    def render(self) -> RenderableType:
        means = self.means()
        last = self.rows[-1] if self.rows else None
        elapsed = time.monotonic() - self.started
        head = Table.grid(padding=(0, 2))
        head.add_column(style="bold")
        head.add_column()
        done = len(self.rows)
        head.add_row("round", f"{done}/{self.total}   task {self.task}   {int(elapsed) // 60}:{int(elapsed) % 60:02d}")
        if last is None:
            head.add_row("reward", "waiting for the first round ...")
        else:
            rolling = statistics.fmean(means[-WINDOW:])
            first = statistics.fmean(means[:WINDOW])
            head.add_row("reward", Text.assemble(
                f"{last.round.mean:.3f}  rolling {rolling:.3f}  first {min(WINDOW, done)} {first:.3f}  ",
                (sparkline(means), "cyan")))
            head.add_row("tokens/s", f"{last.round.tokens_per_s:.1f}")
            head.add_row("staleness", f"{last.staleness} version(s)   policy versions in the round {last.round.versions}")
        head.add_row("weights", f"version {self.version}")
        parts: list[RenderableType] = [head]
        if self.workers:
            parts.append(self._workers_table())
        if self.hosts:
            parts.append(self._hosts_table())
        return Panel(Group(*parts), title=self.title, border_style="blue")

    def _workers_table(self) -> Table:
        t = Table(title="rollout workers", title_justify="left", expand=False)
        for col in ("worker", "state", "version", "running", "tokens", "heard"):
            t.add_column(col, justify="left" if col in ("worker", "state") else "right")
        now = time.time()
        for w in sorted(self.workers, key=lambda w: w.worker_id):
            t.add_row(w.worker_id, Text(w.state, style=STATE_STYLE.get(w.state, "")), str(w.version),
                      f"{w.running}/{w.capacity}", str(w.generated_tokens), f"{max(0.0, now - w.ts):.1f}s ago")
        return t

    def _hosts_table(self) -> Table:
        t = Table(title=f"hosts (scheduler policy {self.policy or '?'})", title_justify="left", expand=False)
        for col in ("host", "tags", "mode", "now", "epoch", "health"):
            t.add_column(col)
        for h in sorted(self.hosts, key=lambda h: h.host):
            mode = h.mode if h.mode == h.target else f"{h.mode}->{h.target}"
            health = ("cordoned" if h.cordoned else "ok") if h.healthy else "DEAD"
            t.add_row(h.host, ",".join(h.tags), Text(mode, style=STATE_STYLE.get(h.mode, "")),
                      Text(h.activity or "-", style=STATE_STYLE.get(h.activity, "")), str(h.epoch), health)
        return t

    # -- lifecycle ----------------------------------------------------------------------------------

    def __enter__(self) -> "DemoView":
        if self.interactive:
            self._live = Live(get_renderable=self.render, console=self.console, refresh_per_second=4,
                              redirect_stdout=True, redirect_stderr=True)
            self._live.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.stop()  # leaves the last frame on screen
            self._live = None
