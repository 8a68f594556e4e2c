"""The tag scheduler on real hosts: scheduler, two host agents with resident vLLM-CPU workers,
the DeepSpeed trainer gated by the scheduler, and openai-SDK agents running the RL loop.

    host-0 {train, rollout, cpu}: the trainer and a resident worker
    host-1 {rollout, cpu}:        a resident worker

One stack serves every test: switching policy is a config change (`set_policy`), not code.
Each policy test drives agents until the trainer has taken a few more steps, then checks:
no agent request failed, every step's gate was granted (it started after its hosts were
reclaimed), and what the policy promises (seamless: lend/reclaim cycles; disaggregated:
host-0 never lent; colocated: host-1 idles while the trainer computes). The last test kills
host-1's worker mid-rollout: its requests continue on another worker.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time

import msgspec
import pytest
import redis.asyncio as aioredis

from seamlessflow.ops import hosts as hostops
from seamlessflow.stack import servers
from seamlessflow.modelgen import eos_id
from seamlessflow.demo.workload import GroupAgents, Load
from services.trajectory.store import DeltaRecord, InFlight
from shared.config import connections
from shared.timeouts import HEARTBEAT_STALE_AFTER
from tests.integration.stack_fixture import make_stack

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.deepspeed]

GROUP_SIZE, GROUPS_PER_STEP = 4, 2
# 4 agents in flight (one group), 2 groups a step, replies of 160-320 tokens, and THINK_S between an
# agent's two turns (a tool call: no device works for it): rollout-bound by construction, however fast
# the box and the control plane, so the trainer waits for data between steps. History: with 64-192-token
# replies and no think time, once a plain turn's tokens came held (Generate.hold_s) and the trajectory
# manager's per-token work left the 2 cores to vLLM, the rollouts outpaced the trainer (it waited 0-1.9 s
# a step instead of 2-5 s) and seamless rightly kept the host: 0-2 lends in 8 steps. 160-320 tokens alone
# held locally (12 lends) but not in CI (0: the trainer computed 2-5 s a step there); 3 s of think time
# with 64-192 tokens lent, but turns were then too short for a weight update to land in one; with the
# same 1 s for every agent, a group generated in lockstep and the update (CI: 0.6-3 s after a batch) fell
# in the group's think time: no turn spanned versions. The think time is drawn per turn from [0, 2 s].
# Whether a turn spans two weight versions here is chance, so these tests print it and do not assert it:
# CI once saw 0 in the seamless window (1-6 in other runs), and long turns did not make it certain (an
# update comes right after the step, which takes the 2 cores while the workers catch up on what they
# generated meanwhile: CI 0 of 32 long turns in groups, here 1 and 0 of 20-30 long turns back to back
# beside the agents; colocated's held requests: 0 in one run). Turns that span versions are asserted by
# test_partial_rollout, whose updates are published while a stream is under way.
CONCURRENT_GROUPS = 1
REPLY_TOKENS = (160, 320)
THINK_S = 1.0
MAX_MODEL_LEN = 512  # a second turn's reply is cut at the context's end
TRAINER = {"group_size": GROUP_SIZE, "groups_per_step": GROUPS_PER_STEP, "lr": 1e-5, "publish_every": 1,
           "checkpoint_every": 5, "keep_versions": 3, "gate_timeout": 60}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model, redis_url):
    tmp = tmp_path_factory.mktemp("sched")
    nats_port = servers.free_port()  # its own NATS: the trainer consumes the whole TRAJECTORIES stream
    nats = servers.start_nats(nats_port, tmp / "nats")
    stack = make_stack(tmp, tiny_model, f"nats://127.0.0.1:{nats_port}", redis_url, policy="seamless",
                       hosts=["train+rollout", "rollout"], train=True, trainer_settings=TRAINER, max_num_seqs=8,
                       max_model_len=MAX_MODEL_LEN)
    stack.conn = connections({"SF_NATS_URL": stack.nats_url, "SF_REDIS_URL": stack.redis_url})
    try:
        wait_for(lambda: serving(stack) == {"host-0", "host-1"}, 240, "both hosts serving")
        yield stack
    finally:
        stack.stop()
        servers.stop(nats)


def ask(stack, op="status", **kw):
    return asyncio.run(hostops.ask(stack.conn, op, **kw))


def serving(stack) -> set[str]:
    try:
        reply = ask(stack)
    except SystemExit:
        return set()
    return {h.host for h in reply.hosts if h.mode == "rollout" and h.target == "rollout" and h.healthy}


def wait_for(cond, timeout: float, what: str, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def trained_steps(stack) -> list[dict]:
    path = stack.data / "trainer" / "trained.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["event"] == "step"]


def gates_refused(stack) -> int:
    """Steps the trainer computed without a granted gate (refused, timed out, or no scheduler)."""
    return (stack.logs / "trainer.log").read_text().count("gate not granted")


def run_policy(stack, policy: str, steps: int, timeout: float = 240):
    """Drive the agents until the trainer has taken `steps` more steps: (agents, timeline, counts' deltas)."""
    ask(stack, "set_policy", policy=policy)
    wait_for(lambda: all(h.mode == h.target for h in ask(stack).hosts), 60, "hosts settled")
    before = ask(stack)
    start = len(trained_steps(stack))
    agents = GroupAgents(stack.gateway_url, stack.api_key, Load(GROUP_SIZE, CONCURRENT_GROUPS, seed=len(policy),
                                                                min_tokens=REPLY_TOKENS[0], max_tokens=REPLY_TOKENS[1],
                                                                think_s=THINK_S))
    assert asyncio.run(agents.run(lambda: len(trained_steps(stack)) >= start + steps, timeout)), \
        f"{policy}: fewer than {steps} trainer steps within {timeout:.0f}s"
    after = ask(stack, "timeline")
    delta = {k: after.counts.get(k, 0) - before.counts.get(k, 0) for k in after.counts}
    return agents, after, delta


def spans(agents: GroupAgents) -> tuple[int, int]:
    """(turns whose tokens came from more than one worker, turns that span weight versions)."""
    turns = [turn for t in agents.trajectories() for turn in t["turns"]]
    return (sum(len({s["worker_id"] for s in turn["segments"]}) > 1 for turn in turns),
            sum(len({s["version"] for s in turn["segments"]}) > 1 for turn in turns))


def test_seamless_lends_and_reclaims_while_agents_never_notice(cluster):
    # 8 steps for 5 lends: a step whose batch is already there when the last one ends leaves nothing
    # to lend, and seamless rightly keeps the host (on a fast box, CI: 4 lends in 6 steps)
    steps = 8
    agents, after, delta = run_policy(cluster, "seamless", steps=steps)
    assert agents.failures == []
    assert delta["reclaims"] >= 5 and delta["lends"] >= 5, delta
    # every step started after its reclaim: no step computed without a granted gate, and each step of
    # the window but the one already running when it opened had its gate granted inside it
    assert gates_refused(cluster) == 0 and delta["gates_granted"] >= steps - 1 and delta["gates_timed_out"] == 0, delta
    host0 = next(h for h in after.hosts if h.host == "host-0")
    assert sum(iv.activity == "switch" for iv in host0.timeline) >= 10
    # Reclaims rarely catch a turn: predicted lending routes to a lent host only turns whose group's
    # p90 length fits before the reclaim. Turns that move between workers are shown by the host-loss
    # test below; turns that span weight versions, here by chance, by test_partial_rollout
    moved, versions = spans(agents)
    print(f"seamless: {delta}; {moved} turn(s) moved between workers, {versions} spanned versions")


def test_disaggregated_never_lends_the_trainer_host(cluster):
    agents, after, delta = run_policy(cluster, "disaggregated", steps=3)
    assert agents.failures == []
    assert delta["lends"] == 0 and delta["gates_granted"] >= 3 - 1 and delta["gates_timed_out"] == 0, delta
    assert gates_refused(cluster) == 0
    host0 = next(h for h in after.hosts if h.host == "host-0")
    assert host0.mode == "train"


def test_colocated_alternates_every_host_with_held_requests(cluster):
    idle_before = sum(iv.activity == "idle" for h in ask(cluster, "timeline").hosts if h.host == "host-1"
                      for iv in h.timeline)
    agents, after, delta = run_policy(cluster, "colocated", steps=3)
    assert agents.failures == []
    assert delta["gates_granted"] >= 3 - 1 and delta["gates_timed_out"] == 0 and gates_refused(cluster) == 0, delta
    host1 = next(h for h in after.hosts if h.host == "host-1")
    assert sum(iv.activity == "idle" for iv in host1.timeline) > idle_before  # host-1 waits out train phases
    moved, versions = spans(agents)
    print(f"colocated: {delta}; {moved} turn(s) moved between workers, {versions} spanned versions")


def test_cordon_drains_a_host_uncordon_brings_it_back_and_the_timeline_exports(cluster, tmp_path):
    from seamlessflow.ops import workers as ops

    ask(cluster, "set_policy", policy="seamless")
    wait_for(lambda: serving(cluster) == {"host-0", "host-1"}, 90, "both hosts serving")
    ask(cluster, "cordon", host="host-1")
    wait_for(lambda: {h.host: h for h in ask(cluster).hosts}["host-1"].mode == "idle", 30, "host-1 drained")
    states = {w.worker_id: w.state for w in asyncio.run(ops.worker_statuses(cluster.conn))}
    assert states["host-1-rollout"] == "sleeping" and states["host-0-rollout"] == "serving"
    ask(cluster, "uncordon", host="host-1")
    wait_for(lambda: "host-1" in serving(cluster), 30, "host-1 serving again")
    with pytest.raises(SystemExit, match="unknown host"):
        ask(cluster, "cordon", host="host-9")
    out = tmp_path / "timeline.json"
    summary = hostops.write_timeline(ask(cluster, "timeline"), out)
    doc = json.loads(out.read_text())
    assert set(doc["hosts"]) == {"host-0", "host-1"} and "host-0:" in summary
    for h in doc["hosts"].values():
        assert abs(sum(h["fractions"].values()) - 1.0) < 1e-6
        assert all(t0 <= t1 for _, t0, t1 in h["intervals"])


def test_a_killed_worker_is_detected_its_requests_resume_and_the_host_rejoins(cluster, tiny_model):
    ask(cluster, "set_policy", policy="seamless")
    wait_for(lambda: serving(cluster) == {"host-0", "host-1"}, 90, "both hosts serving")
    restarts = {h.host: h for h in ask(cluster).hosts}["host-1"].epoch
    pid = int(subprocess.check_output(["pgrep", "-f", "worker-id host-1-rollout"]).split()[0])
    # longer replies than the policy tests: a turn lasts long enough that a kill finds tokens in flight
    # (think time as in the policy tests: the trainer waits for data, so seamless lends host-0, where the
    # requests cut by the kill resume while host-1's worker restarts)
    # streamed, so that a request's persisted tokens are all it has generated (a plain turn's come held and
    # are persisted in chunks: CI killed a worker whose request showed 64 tokens in Redis and had just ended
    # by length, and no turn moved)
    # and never end early: CI once killed the worker as a request 42 tokens in ended by EOS, and nothing moved
    eos = eos_id(tiny_model)
    load = Load(GROUP_SIZE, 2, seed=7, min_tokens=256, max_tokens=384, think_s=THINK_S, stream=True,
                logit_bias={str(eos): -100.0})
    agents = GroupAgents(cluster.gateway_url, cluster.api_key, load)
    killed = {"t": 0.0, "tokens": 0, "rid": ""}

    async def on_host_1(r) -> dict[str, int]:
        """Requests running on host-1 that have just begun: their persisted delta records all name host-1,
        and 128+ tokens are still to come (min_tokens is 256, and the context, MAX_MODEL_LEN, has room for
        128 more after the prompt and what came so far: CI killed the worker as a second turn, its prompt
        the first turn's 300-odd tokens, was 112 tokens in and 8 from the context's end; it ended there and
        nothing moved). The first delta of a dispatch is persisted at once with the request's prompt
        (docs/architecture.md, sf:req:<rid>, sf:req:<rid>:deltas); a heartbeat's running count (up to 1 s
        old, turns of ~1 s) promised nothing."""
        found = {}
        async for key in r.scan_iter(match="sf:req:*:deltas", count=500):
            rid = key.decode().removeprefix("sf:req:").removesuffix(":deltas")
            recs = [msgspec.msgpack.decode(x, type=DeltaRecord) for x in await r.lrange(key, 0, -1)]
            n = sum(len(d.token_ids) for d in recs)
            if not (recs and all(d.worker == "host-1-rollout" for d in recs) and 0 < n <= 128):
                continue
            if (raw := await r.get(f"sf:req:{rid}")) is None:
                continue  # ended meanwhile
            prompt = len(msgspec.msgpack.decode(raw, type=InFlight).prompt_ids)
            if MAX_MODEL_LEN - prompt - n >= 128:
                found[rid] = n
        return found

    async def growing_on_host_1(r) -> tuple[str, int]:
        """(request id, tokens) of a request on host-1 whose persisted tokens grew between two looks, else
        ("", 0). Growth shows its tokens are arriving as generated: CI once found a request 3 tokens in
        whose other 369 had all been generated meanwhile and came at once with its GenerateDone (a worker
        starved on the loaded box sends what piled up as one delta); the kill then cut nothing."""
        first = await on_host_1(r)
        if not first:
            return "", 0
        await asyncio.sleep(0.05)
        later = await on_host_1(r)
        grown = [(rid, n) for rid, n in later.items() if rid in first and n > first[rid]]
        return min(grown, key=lambda x: x[1]) if grown else ("", 0)

    async def scenario():
        r = aioredis.from_url(cluster.conn.redis_url)

        async def kill_mid_request():
            await asyncio.sleep(4.0)
            deadline = time.monotonic() + 60
            while not (found := await growing_on_host_1(r))[1]:
                if time.monotonic() > deadline:
                    raise AssertionError("no request was seen growing on host-1's worker within 60 s")
                await asyncio.sleep(0.02)
            os.kill(pid, signal.SIGKILL)
            killed["t"], (killed["rid"], killed["tokens"]) = time.monotonic(), found

        try:
            await asyncio.gather(kill_mid_request(),
                                 agents.run(lambda: killed["t"] and time.monotonic() - killed["t"] > 12, 120))
        finally:
            await r.aclose()

    asyncio.run(scenario())
    assert agents.failures == []
    # requests in flight on the dead worker resumed elsewhere within the heartbeat timeout plus two turns'
    # time (the part before the kill, the rest after it), a turn as long as the slowest one before the kill
    spanning = [d for t0, d in agents.latencies if t0 < killed["t"] < t0 + d]
    turn = max(d for t0, d in agents.latencies if t0 + d < killed["t"])
    assert spanning and max(spanning) < HEARTBEAT_STALE_AFTER + 2 * turn + 3.0, (sorted(spanning)[-3:], turn)
    # and the request the kill cut shows it: segments from the dead worker, then from another
    turns = {turn["request_id"]: turn for t in agents.trajectories() for turn in t["turns"]}
    cut = turns.get(killed["rid"])
    assert cut is not None, f"the request cut by the kill ({killed['rid']}) is in no finished session"
    path = [(s["worker_id"], len(s["token_ids"])) for s in cut["segments"]]
    moved = [w for w in ([s["worker_id"] for s in t["segments"]] for t in turns.values())
             if "host-1-rollout" in w and len(set(w)) > 1]
    print(f"host loss: request {killed['rid']} was {killed['tokens']} tokens in at the kill; its segments "
          f"(worker, tokens): {path}; {len(moved)} turn(s) in all continued on another worker")
    assert path[0][0] == "host-1-rollout" and len(path) > 1 and path[-1][0] != "host-1-rollout", path

    wait_for(lambda: {h.host: h for h in ask(cluster).hosts}["host-1"].epoch > restarts
             and "host-1" in serving(cluster), 120, "host-1 back in rollout after its worker restarted")
    log = (cluster.logs / "scheduler.log").read_text()
    assert "host host-1 dead" in log and "host host-1 is back" in log


def test_the_leader_killed_during_a_lend_a_standby_leads_within_5s_and_no_step_runs_beside_a_lend(cluster):
    """Issue 30: a second scheduler stands by; the leader is SIGKILLed while host-0 is lent (its trainer
    host serving rollout) with the trainer and the agents running. The standby leads within 5 s
    (services/scheduler/leader.py), reclaims and lends host-0 in its own term, and every step still
    starts after its gate is granted: in the leader gap the trainer asks again (SF_TRAINER_GATE_LEADER_GAP)
    rather than computing beside the lent host's engine. Per host, applied epochs only rise."""
    from shared import bus, subjects
    from shared.codec import decode
    from shared.messages.scheduler import HostModeChanged, SchedulerLeader
    from services.scheduler.leader import TERM_SHIFT

    ask(cluster, "set_policy", policy="seamless")
    wait_for(lambda: serving(cluster) == {"host-0", "host-1"}, 90, "both hosts serving")
    leader_proc = next(p for p in cluster.procs if p.name == "scheduler")
    standby = cluster.spawn_scheduler("scheduler-b")
    wait_for(lambda: "standby:" in standby.log.read_text(errors="replace"), 60, "the second scheduler standing by")
    refused_before = gates_refused(cluster)
    start = len(trained_steps(cluster))
    agents = GroupAgents(cluster.gateway_url, cluster.api_key, Load(GROUP_SIZE, CONCURRENT_GROUPS, seed=11,
                                                                    min_tokens=REPLY_TOKENS[0],
                                                                    max_tokens=REPLY_TOKENS[1], think_s=THINK_S))
    seen = {"changed": [], "leaders": []}
    killed = {"t": 0.0, "step": 0}

    async def scenario():
        nc = await bus.connect(cluster.conn, name="leader-kill-test")

        async def on_changed(m):
            seen["changed"].append((time.monotonic(), decode(m.data, HostModeChanged)))

        async def on_leader(m):
            seen["leaders"].append((time.monotonic(), decode(m.data, SchedulerLeader)))

        await nc.subscribe(subjects.SCHED_CHANGED, cb=on_changed)
        await nc.subscribe(subjects.SCHED_LEADER, cb=on_leader)

        async def kill_during_a_lend():
            # a lend that happens now: host-0 switched to rollout after the agents started
            t0 = time.monotonic()
            deadline = t0 + 180
            while not any(t > t0 + 1 and c.host == "host-0" and c.mode == "rollout" and c.ok
                          for t, c in seen["changed"]):
                assert time.monotonic() < deadline, "host-0 was not lent within 180 s"
                await asyncio.sleep(0.05)
            os.killpg(leader_proc.popen.pid, signal.SIGKILL)
            killed["t"], killed["step"] = time.monotonic(), len(trained_steps(cluster))

        try:
            await asyncio.gather(kill_during_a_lend(), agents.run(
                lambda: killed["t"] and len(trained_steps(cluster)) >= killed["step"] + 4, 300))
        finally:
            await nc.close()

    try:
        asyncio.run(scenario())
    finally:
        cluster.kill("scheduler")  # the stack forgets it (SIGKILLed already); scheduler-b stays to the end
    assert agents.failures == []
    # 1. the standby leads within 5 s, in a new term
    terms = [(t, ldr) for t, ldr in seen["leaders"] if t > killed["t"]]
    new = next(((t, ldr) for t, ldr in terms if ldr.instance.endswith(f"-{standby.popen.pid}")), None)
    assert new is not None, f"no announcement from the standby after the kill: {seen['leaders'][-3:]}"
    took = new[0] - killed["t"]
    old_terms = {ldr.term for t, ldr in seen["leaders"] if t < killed["t"]}
    print(f"leader killed during a lend at step {killed['step']}: the standby led {took:.2f} s later "
          f"(term {new[1].term}, before {sorted(old_terms)}); {len(trained_steps(cluster)) - start} steps")
    assert took <= 5.0 and new[1].term > max(old_terms, default=0)
    # 2. the new leader reclaimed and lent host-0 in its own term
    mine = [c for t, c in seen["changed"] if t > killed["t"] and c.host == "host-0" and c.epoch >> TERM_SHIFT
            == new[1].term and c.ok]
    assert {"train", "rollout"} <= {c.mode for c in mine}, [(c.mode, c.epoch) for c in mine]
    # 3. one mode at a time: every step's gate granted (none computed beside a lend), epochs only rise
    assert gates_refused(cluster) == refused_before, "a step computed without a granted gate"
    for host in ("host-0", "host-1"):
        epochs = [c.epoch for _, c in seen["changed"] if c.host == host]
        assert epochs == sorted(set(epochs)), (host, epochs)
