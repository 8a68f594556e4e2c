"""The status page (/ui) against a running stack (2 rollout workers), in real headless Chromium.

The workers are the real rollout service around the SIMULATED engine (services/rollout/simulated.py):
the page is the subject here, not vLLM, and the stack starts in seconds.

Chromium is Debian's `chromium`: `bash scripts/bootstrap.sh browser` installs it where apt is
available; elsewhere the browser test skips and says why. It is driven by plain
`chromium --headless --dump-dom` / `--screenshot` calls (no test tool's browser download).
The screenshot is saved to var/test-artifacts/status-page.png.

The trainer is played by the test through its own wire formats, so the page's trainer row,
reward and staleness have data without a DeepSpeed engine: TrainerStatus heartbeats on
sf.trainer.status, and `services.trainer.metrics.Metrics` (the trainer's own code) serving
Prometheus text on a free port that SF_GATEWAY_TRAINER_METRICS_URL points at.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import shutil
import struct
import subprocess
import time
from pathlib import Path

import httpx
import nats
import openai
import pytest

from seamlessflow.stack import servers
from shared import subjects
from shared.codec import encode
from shared.messages.scheduler import TrainerStatus
from tests.integration.stack_fixture import make_stack

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "var" / "test-artifacts" / "status-page.png"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1400,1000", "--virtual-time-budget=8000"]


@pytest.fixture(scope="module")
def trainer_metrics_port():
    from services.trainer.metrics import Metrics

    port = servers.free_port()
    m = Metrics(port=port)
    m.step(3, 3, {"reward_mean": 0.62, "reward_std": 0.2, "loss": 0.0123, "train_tokens_per_s": 850.0},
           {0: 300, 1: 120, 2: 10})
    return port


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model, nats_url, redis_url, trainer_metrics_port):
    s = make_stack(tmp_path_factory.mktemp("ui"), tiny_model, nats_url, redis_url, workers=2, simulated=True,
                   extra_env={"SF_GATEWAY_TRAINER_METRICS_URL": f"http://127.0.0.1:{trainer_metrics_port}/metrics"})
    yield s
    s.stop()


def _agent_turns(stack, n: int = 8) -> None:
    def one(i: int) -> None:
        user = {"Authorization": f"Bearer {stack.api_key}"}
        sess = httpx.post(f"{stack.gateway_url}/sessions", headers=user, json={"group_id": f"ui-{i // 4}"}).json()
        agent = openai.OpenAI(base_url=stack.gateway_url, api_key=sess["api_key"], max_retries=0, timeout=120)
        agent.chat.completions.create(model="seamlessflow-tiny", max_tokens=32,
                                      messages=[{"role": "user", "content": f"reverse {100 + i}"}])
        httpx.post(f"{stack.gateway_url}/sessions/{sess['id']}/finish", headers=user,
                   json={"reward": 0.25 * (i % 4)}).raise_for_status()

    with cf.ThreadPoolExecutor(4) as ex:
        list(ex.map(one, range(n)))


async def _trainer_heartbeats(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        for state, step in (("waiting", 2), ("computing", 2), ("computing", 2), ("publishing", 3), ("waiting", 3)):
            st = TrainerStatus(state=state, step=step, version=step, ready_groups=0, open_groups=1,
                               buffered_samples=4, groups_per_step=4, group_size=8, last_wait_s=1.5,
                               last_compute_s=0.8, ts=time.time())
            await nc.publish(subjects.TRAINER_STATUS, encode(st))
            await nc.flush()
            await asyncio.sleep(0.6)
    finally:
        await nc.close()


@pytest.fixture(scope="module")
def traffic(stack, nats_url):
    _agent_turns(stack)
    asyncio.run(_trainer_heartbeats(nats_url))
    return stack


def test_the_page_and_its_data_need_the_admin_key(stack):
    admin, key = stack.admin_url, stack.admin_key
    page = httpx.get(f"{admin}/ui")
    assert page.status_code == 401 and 'name="key"' in page.text  # a login form, not a JSON error
    assert httpx.get(f"{admin}/ui/api/status").status_code == 401
    assert httpx.get(f"{admin}/ui?key=wrong").status_code == 401
    assert httpx.get(f"{admin}/ui/api/status", headers={"authorization": f"Bearer {key}"}).status_code == 200

    signed = httpx.get(f"{admin}/ui", params={"key": key})
    assert signed.status_code == 303 and signed.headers["location"] == "/ui"
    cookie = signed.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and key not in cookie
    jar = {"sf_ui": signed.cookies["sf_ui"]}
    assert httpx.get(f"{admin}/ui", cookies=jar).status_code == 200
    assert httpx.get(f"{admin}/ui/api/status", cookies=jar).status_code == 200
    assert httpx.get(f"{admin}/admin/workers", cookies=jar).status_code == 401  # the cookie opens /ui only
    form = httpx.post(f"{admin}/ui/login", data={"key": key})
    assert form.status_code == 303 and "sf_ui=" in form.headers["set-cookie"]
    assert httpx.get(f"{admin}/ui/static/ui.js").status_code == 200
    assert key not in (stack.logs / "gateway.log").read_text()


def test_status_json_has_workers_turns_rewards_and_trainer(traffic):
    st = httpx.get(f"{traffic.admin_url}/ui/api/status", params={"window": 300},
                   headers={"authorization": f"Bearer {traffic.admin_key}"}).json()
    assert sorted(w["id"] for w in st["workers"]) == ["rollout-0", "rollout-1"]
    assert set(st["worker_timeline"]) == {"rollout-0", "rollout-1"}
    assert all(iv[0] in ("rollout", "idle") for ivs in st["worker_timeline"].values() for iv in ivs)
    assert st["versions"] == {"0": ["rollout-0", "rollout-1"]}
    assert st["turns_total"] >= 8 and st["sessions_created"] >= 8 and st["in_flight_sessions"] == 0
    assert st["reward_mean_60s"] == pytest.approx(0.375)
    assert st["trainer"]["state"] == "waiting" and st["trainer"]["step"] == 3
    assert [iv[0] for iv in st["trainer_timeline"]] == ["idle", "train", "publish", "idle"]
    assert st["trainer_metrics"]["reward_mean"] == pytest.approx(0.62)
    assert st["trainer_metrics"]["staleness_mean"] == pytest.approx((120 + 20) / 430)
    assert st["scheduler"] is None  # no tag scheduler in this stack


@pytest.fixture(scope="module")
def chromium() -> str:
    found = shutil.which("chromium")
    if not found:
        done = subprocess.run(["bash", str(ROOT / "scripts" / "bootstrap.sh"), "browser"], capture_output=True,
                              text=True, timeout=900)
        found = shutil.which("chromium")
        if not found:
            pytest.skip("Debian's chromium is not installed and bootstrap could not install it: "
                        + (done.stderr.strip().splitlines() or ["(no output)"])[-1])
    return found


def _run_chromium(binary: str, profile: Path, url: str, *mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([binary, *FLAGS, f"--user-data-dir={profile}", *mode, url], capture_output=True,
                          text=True, timeout=120)


def test_chromium_shows_the_workers_timeline(traffic, chromium, tmp_path):
    url = f"{traffic.admin_url}/ui?key={traffic.admin_key}"  # signs in, then redirects to /ui
    dom = _run_chromium(chromium, tmp_path / "profile", url, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert 'data-ready="1"' in dom.stdout, dom.stdout[-3000:]
    for row in ("worker:rollout-0", "worker:rollout-1", "trainer"):
        assert f'data-row="{row}"' in dom.stdout
    assert 'data-activity="idle"' in dom.stdout  # bubbles are drawn

    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    SCREENSHOT.unlink(missing_ok=True)
    shot = _run_chromium(chromium, tmp_path / "profile", url, f"--screenshot={SCREENSHOT}")
    assert shot.returncode == 0, shot.stderr[-2000:]
    png = SCREENSHOT.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", png[16:24]) == (1400, 1000)
