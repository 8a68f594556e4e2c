"""services/trajectory/generation.py: one generation across preemptions. The code under test
stays real; only the rollout transport (`call`) is faked, at the edge."""

from __future__ import annotations

import pytest

from services.trajectory.generation import GenerationFailed, Job, generate
from services.trajectory.tokenpath import TokenPath
from shared.codec import decode, encode
from shared.messages import Generate, GenerateDone, Sampling, TokenDelta


def _fake_worker(script):
    """`script` maps dispatch number -> list of replies; records what was sent."""
    sent = []

    async def call(worker, cmd):
        sent.append((worker, decode(encode(cmd), Generate)))  # as the worker reads it off the wire
        for r in script[len(sent) - 1]:
            yield r

    return call, sent


async def _only_worker_w(exclude):
    return "w"


async def _keep_every_token(delta, worker, first, final):
    return None  # no stop string: keep the whole delta

async def test_generation_redispatches_prompt_plus_partial_after_preemption():
    call, sent = _fake_worker({
        0: [TokenDelta("r.0", [10, 11], [-1.0, -1.1], 0), GenerateDone("r.0", "preempted", 3, 0)],
        1: [TokenDelta("r.1", [12], [-1.2], 1), TokenDelta("r.1", [2], [-0.1], 1), GenerateDone("r.1", "stop", 5, 1)],
    })
    workers = iter(["w1", "w2"])
    excluded = []

    async def pick(exclude):
        excluded.append(exclude)
        return next(workers)

    seen = []

    async def on_tokens(delta, worker, first, final):
        seen.extend(delta.token_ids)

    out = await generate(call, pick, Job("r", "s", TokenPath.of([1, 2, 3]), Sampling(max_tokens=8)), on_tokens, 4)
    assert out.finish_reason == "stop"
    assert out.token_ids == seen == [10, 11, 12, 2]
    assert [(s.token_ids, s.version, s.worker_id) for s in out.segments] == [([10, 11], 0, "w1"), ([12, 2], 1, "w2")]
    assert sent[1][1].prompt_ids == [1, 2, 3, 10, 11]
    assert sent[1][1].sampling.max_tokens == 6
    assert excluded == [frozenset(), frozenset({"w1"})]


async def test_generation_gives_up_after_bounded_redispatches():
    call, _ = _fake_worker({i: [GenerateDone("r", "preempted", 1, 0)] for i in range(10)})

    pick, on_tokens = _only_worker_w, _keep_every_token

    with pytest.raises(GenerationFailed, match="preempted"):
        await generate(call, pick, Job("r", "s", TokenPath.of([1]), Sampling(max_tokens=4)), on_tokens, 3, backoff=0.0)


@pytest.mark.parametrize("done,status", [
    # the worker's code decides, never the words of its message (bug: "longer than" in the text meant 400)
    (GenerateDone("r", "error", 1, 0, error="prompt of 9 tokens does not fit", code="context_length"), 400),
    (GenerateDone("r", "error", 1, 0, error="bad sampling: top_p", code="bad_request"), 400),
    (GenerateDone("r", "error", 1, 0, error="CUDA error while longer than max_model_len", code="internal"), 500),
    (GenerateDone("r", "error", 1, 0, error="an old worker's error: no code"), 500),
])
async def test_generation_error_maps_to_status_by_the_workers_code(done, status):
    call, _ = _fake_worker({0: [done]})

    pick, on_tokens = _only_worker_w, _keep_every_token

    with pytest.raises(GenerationFailed) as e:
        await generate(call, pick, Job("r", "s", TokenPath.of([1]), Sampling(max_tokens=4)), on_tokens, 3, backoff=0.0)
    assert e.value.status == status and done.error in str(e.value)


async def test_generation_resumes_from_persisted_partial():
    from services.trajectory.generation import Generated

    partial = Generated()
    partial.add(TokenDelta("r.0", [10, 11], [-1.0, -1.1], 0), "w1", True)
    partial.dispatches = 1
    call, sent = _fake_worker({0: [TokenDelta("r.1", [2], [-0.1], 0), GenerateDone("r.1", "stop", 5, 0)]})

    async def pick(exclude):
        return "w2"

    async def on_tokens(delta, worker, first, final):
        pass

    job = Job("r", "s", TokenPath.of([1, 2, 3]), Sampling(max_tokens=8))
    out = await generate(call, pick, job, on_tokens, 4, resume=partial)
    assert sent[0][1].prompt_ids == [1, 2, 3, 10, 11] and sent[0][1].sampling.max_tokens == 6
    assert sent[0][1].request_id == "r.1"
    assert out.token_ids == [10, 11, 2] and len(out.segments) == 2


async def test_scheduled_preemptions_count_neither_toward_the_limit_nor_the_backoff():
    import time

    def moved(i):  # a reclaim by the tag scheduler vacated the worker
        return GenerateDone(f"r.{i}", "preempted", 1, 0, "w", scheduled=True)

    script = [[TokenDelta("r.0", [5], [-0.5], 0), moved(0)], [moved(1)], [moved(2)],
              [GenerateDone("r.3", "preempted", 1, 0, "w")],  # one ordinary preemption: within the limit
              [TokenDelta("r.4", [6], [-0.6], 0), GenerateDone("r.4", "length", 2, 0, "w")]]
    call, sent = _fake_worker(script)

    pick, on_tokens = _only_worker_w, _keep_every_token

    t0 = time.monotonic()
    out = await generate(call, pick, Job("r", "s", TokenPath.of([1]), Sampling(max_tokens=2)), on_tokens, 1,
                         backoff=0.5)
    assert out.token_ids == [5, 6] and out.finish_reason == "length" and len(sent) == 5
    assert time.monotonic() - t0 < 0.4  # counted, the moves would fail it (limit 1) and back off (0.5 s, 1 s)


async def test_scheduled_preemptions_are_still_bounded(monkeypatch):
    from services.trajectory import generation

    monkeypatch.setattr(generation, "MAX_SCHEDULED_PREEMPTIONS", 5)
    call, sent = _fake_worker({i: [GenerateDone(f"r.{i}", "preempted", 1, 0, "w", scheduled=True)]
                               for i in range(10)})

    pick, on_tokens = _only_worker_w, _keep_every_token

    with pytest.raises(GenerationFailed, match="moved by the scheduler 6 times"):
        await generate(call, pick, Job("r", "s", TokenPath.of([1]), Sampling(max_tokens=4)), on_tokens, 3, backoff=0.0)
    assert len(sent) == 6


async def test_repeated_preemptions_back_off_before_redispatching():
    import time

    from shared.messages import GenerateDone, TokenDelta

    script = [[TokenDelta("r.0", [5], [-0.5], 0), GenerateDone("r.0", "preempted", 1, 0, "w")]] + \
        [[GenerateDone(f"r.{i}", "preempted", 1, 0, "w")] for i in range(1, 4)] + \
        [[TokenDelta("r.4", [6], [-0.6], 0), GenerateDone("r.4", "length", 2, 0, "w")]]
    call, sent = _fake_worker(script)

    pick, on_tokens = _only_worker_w, _keep_every_token  # "w" is the only worker

    t0 = time.monotonic()
    out = await generate(call, pick, Job("r", "s", TokenPath.of([1]), Sampling(max_tokens=2)), on_tokens, 8,
                         backoff=0.05)
    waited = time.monotonic() - t0
    assert out.token_ids == [5, 6] and len(sent) == 5
    assert 0.05 + 0.1 + 0.2 <= waited < 2.0  # no wait after the first preemption, then doubling


async def test_generation_ends_stop_when_on_tokens_says_so_and_closes_the_call():
    from shared.messages import GenerateDone, TokenDelta

    closed = []

    async def call(worker, cmd):
        try:
            yield TokenDelta("r.0", [1, 2], [-0.1, -0.2], 0)
            yield TokenDelta("r.0", [3, 4, 5], [-0.3, -0.4, -0.5], 0)
            yield GenerateDone("r.0", "length", 1, 0, "w")
        finally:
            closed.append(True)  # the real call aborts the worker's request here

    async def pick(exclude):
        return "w"

    async def on_tokens(delta, worker, first, final):
        return 2 if 4 in delta.token_ids else None  # "a stop string completed at token 4"

    out = await generate(call, pick, Job("r", "s", TokenPath.of([0]), Sampling(max_tokens=10)), on_tokens, 3)
    assert out.finish_reason == "stop" and out.token_ids == [1, 2, 3, 4] and closed == [True]
    assert [s.logprobs for s in out.segments] == [[-0.1, -0.2, -0.3, -0.4]]


async def test_the_held_tail_on_a_done_gives_its_tokens_marked_final_only_when_it_ends_the_generation():
    # a plain turn's reply rides on the worker's GenerateDone (shared/deltas.Held); tokens that end the
    # generation are marked final (chat.py saves them with the turn instead of appending them first), a
    # preempted dispatch's tail is not (a resume must find them)
    call, sent = _fake_worker({
        0: [TokenDelta("r.0", [10], [-1.0], 0),
            GenerateDone("r.0", "preempted", 3, 0, tail_ids=[11, 12], tail_logprobs=[-1.1, -1.2])],
        1: [GenerateDone("r.1", "stop", 6, 1, tail_ids=[13, 2], tail_logprobs=[-1.3, -0.2])],
    })
    seen = []

    async def on_tokens(delta, worker, first, final):
        seen.append((delta.token_ids, delta.version, first, final))

    job = Job("r", "s", TokenPath.of([1, 2, 3]), Sampling(max_tokens=8))
    out = await generate(call, _only_worker_w, job, on_tokens, 4)
    assert seen == [([10], 0, True, False), ([11, 12], 0, False, False), ([13, 2], 1, True, True)]
    assert out.finish_reason == "stop" and out.token_ids == [10, 11, 12, 13, 2]
    assert [(s.token_ids, s.logprobs, s.version) for s in out.segments] == [
        ([10, 11, 12], [-1.0, -1.1, -1.2], 0), ([13, 2], [-1.3, -0.2], 1)]
    assert sent[1][1].prompt_ids == [1, 2, 3, 10, 11, 12]


async def test_a_stop_string_in_the_held_tail_ends_the_generation_there():
    call, _ = _fake_worker({0: [GenerateDone("r.0", "length", 1, 0, tail_ids=[1, 2, 3], tail_logprobs=[-0.1] * 3)]})

    async def on_tokens(delta, worker, first, final):
        assert final
        return 2  # "a stop string completed at the tail's second token"

    out = await generate(call, _only_worker_w, Job("r", "s", TokenPath.of([0]), Sampling(max_tokens=3)), on_tokens, 3)
    assert out.finish_reason == "stop" and out.token_ids == [1, 2]
