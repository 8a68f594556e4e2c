"""SmolLM2's checkpoint builder, without its weights: the missing extra's error, and the chat template
(rendered here with the tiny model's tokenizer) in the tool format shared/toolcalls.py parses."""

from __future__ import annotations

import json

import pytest

from seamlessflow import smollm2
from shared import toolcalls

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "evaluate arithmetic",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}}]
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": json.dumps({"expression": "2+3"})}}]}


@pytest.fixture(scope="module")
def tok(tiny_model):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tiny_model)
    t.chat_template = smollm2.CHAT_TEMPLATE
    return t


def render(tok, messages, tools=None, gen=False) -> str:
    return tok.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, tokenize=False)


def test_missing_extra_names_the_install(monkeypatch):
    real = smollm2.importlib.util.find_spec
    monkeypatch.setattr(smollm2.importlib.util, "find_spec",
                        lambda name: None if name == smollm2.GGUF_PACKAGE else real(name))
    with pytest.raises(smollm2.ExtraMissing, match="bootstrap.sh.*requirements/smollm2.txt"):
        smollm2.gguf_path()


def test_default_system_prompt_is_smollm2s(tok):
    assert render(tok, [{"role": "user", "content": "hi"}], gen=True) == (
        f"<|im_start|>system\n{smollm2.DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_tools_and_calls_render_in_the_format_the_gateway_parses(tok):
    msgs = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "2+3?"}, CALL,
            {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    text = render(tok, msgs, TOOLS, gen=True)
    assert text.startswith("<|im_start|>system\nUse tools.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in text
    reply = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert reply == '<tool_call>\n{"name": "calc", "arguments": {"expression": "2+3"}}\n</tool_call>'
    content, calls = toolcalls.parse(reply, "r1")
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("calc", {"expression": "2+3"})]
    assert text.endswith("<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n")


def test_history_renders_as_a_prefix_of_the_next_turn(tok):
    """What the trajectory manager needs to extend a turn rather than start a new branch."""
    history = [{"role": "user", "content": "2+3?"}, CALL]
    new = [{"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    assert render(tok, history + new, TOOLS, gen=True).startswith(render(tok, history, TOOLS))
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"}]
    assert render(tok, history + [{"role": "user", "content": "2+3?"}], gen=True).startswith(render(tok, history))
