"""The demo's live view, rendered through rich's recording console: a terminal gets the
panel (round, reward + sparkline, tokens/s, staleness, version, workers, hosts); a pipe gets
one plain line per round. No servers: fake rounds, heartbeats and hosts."""

from __future__ import annotations

import io
import time

from rich.console import Console

from seamlessflow.demo.live import DemoView, sparkline
from seamlessflow.demo.rl import Round
from shared.messages import WorkerStatus
from shared.messages.scheduler import HostInfo


def _round(i: int, mean: float) -> Round:
    return Round(i, [mean] * 4, [max(0, i - 1), i], seconds=2.0, tokens=100, t_end=2.0 * (i + 1))


def _worker(wid: str, state: str, version: int) -> WorkerStatus:
    return WorkerStatus(worker_id=wid, state=state, version=version, running=3, capacity=16, model="m",
                        max_model_len=2048, ts=time.time(), generated_tokens=1234)


def test_sparkline_uses_a_fixed_scale():
    assert sparkline([0.0, 0.5, 1.0]) == "▁▅█"
    assert sparkline([2.0, -1.0]) == "█▁"  # clipped
    assert len(sparkline([0.5] * 100, width=40)) == 40


def test_terminal_renders_the_panel():
    console = Console(record=True, force_terminal=True, width=120, color_system="truecolor")
    view = DemoView("calc", 60, console=console)
    for i, m in enumerate([0.2, 0.3, 0.5, 0.6]):
        view.add_round(_round(i, m), staleness=1, version=i + 1)
    view.workers = [_worker("rollout-0", "serving", 4), _worker("rollout-1", "updating", 3)]
    view.hosts = [HostInfo(host="host-0", tags=["train", "rollout", "cpu"], capacity=1.0, mode="train",
                           target="rollout", epoch=3, healthy=True, cordoned=False, last_seen=time.time(),
                           activity="switch")]
    view.policy = "seamless"
    console.print(view.render())
    styled = console.export_text(styles=True, clear=False)
    text = console.export_text()
    assert "round" in text and "4/60" in text and "task calc" in text
    assert "0.600" in text and sparkline([0.2, 0.3, 0.5, 0.6]) in text  # last mean, sparkline
    assert "50.0" in text  # tokens/s: 100 tokens in 2 s
    assert "staleness" in text and "version 4" in text
    assert "rollout-0" in text and "serving" in text and "rollout-1" in text and "updating" in text
    assert "host-0" in text and "train->rollout" in text and "switch" in text and "seamless" in text
    assert "\x1b[" in styled  # colours on a terminal


def test_live_context_draws_on_a_terminal():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=100)
    with DemoView("reverse", 3, console=console) as view:
        assert view.interactive
        view.workers = [_worker("rollout-0", "serving", 0)]
        view.add_round(_round(0, 0.4), staleness=0, version=0)
        view._live.refresh()
    out = buf.getvalue()
    assert "1/3" in out and "rollout-0" in out and "round   1/3" not in out  # the panel, not plain lines


def test_pipe_gets_plain_lines():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=False, width=300)
    with DemoView("reverse", 3, console=console) as view:
        assert not view.interactive and view._live is None
        view.workers = [_worker("rollout-0", "serving", 2)]
        view.add_round(_round(0, 0.4), staleness=1, version=2)
        view.add_round(_round(1, 0.6), staleness=0, version=2)
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[1].startswith("round   2/3: mean reward 0.600 (rolling 0.500)")
    assert "50.0 tok/s" in lines[1] and "staleness 0" in lines[1] and "rollout-0=serving@v2" in lines[1]
    assert "\x1b[" not in buf.getvalue()
