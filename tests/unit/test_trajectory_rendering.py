"""Rendering against the real tokenizer built by `init-model`: continuation tokens equal a
full render wherever the model's tokens are canonical, and drift shows where they are not."""

from __future__ import annotations

import pytest

from services.trajectory.rendering import IncrementalText, Renderer, RenderError


@pytest.fixture(scope="module")
def renderer(tiny_model):
    return Renderer.from_pretrained(str(tiny_model))


def test_continuation_matches_full_render_for_canonical_tokens(renderer):
    history = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"},
               {"role": "assistant", "content": "hi there"}]
    new = [{"role": "user", "content": "reverse 123"}]
    first = renderer.prompt(history[:2], [])
    reply = renderer.encode("hi there") + [renderer.eos_id]
    cont = renderer.continuation(history, new, [], history_ends_with_eos=True)
    assert first + reply + cont == renderer.prompt(history + new, [])
    # a reply cut by max_tokens gets the end-of-turn token as glue (mask 0)
    cont2 = renderer.continuation(history, new, [], history_ends_with_eos=False)
    assert cont2[0] == renderer.eos_id and cont2[1:] == cont


def test_continuation_refuses_when_template_prefix_changes(renderer):
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    # same messages, but the system block now lists tools: not a prefix any more
    before = renderer.render(history, [], gen=False)
    after = renderer.render(history + [{"role": "user", "content": "c"}], tools, gen=True)
    assert not after.startswith(before)


def test_retokenization_drift_exists_for_sampled_tokens(renderer):
    """Byte-level BPE: the model may sample "he"+"llo" where the tokenizer would write "hello"."""
    canonical = renderer.encode(" hello world")
    split = [t for ch in " hello world" for t in renderer.encode(ch)]
    assert renderer.decode(split) == renderer.decode(canonical)
    assert split != canonical


def test_incremental_text_holds_partial_utf8(renderer):
    ids = renderer.encode("é!")
    inc = IncrementalText(renderer)
    pieces = [inc.add([i]) for i in ids]
    assert "".join(pieces) == "é!" and inc.final() == "é!"


def test_bad_template_input_is_a_render_error(renderer):
    with pytest.raises(RenderError):
        renderer.render([{"role": "assistant", "content": "x", "tool_calls": [{"function": {}}]}], [], gen=True)


def test_incremental_text_streams_bytes_that_never_form_a_character(renderer):
    """A model may sample byte tokens that never complete a UTF-8 character; the stream
    must not stall on them until the end of the reply."""
    tok = renderer.tok
    lone = [i for i in range(len(tok)) if tok.decode([i]) == "\ufffd"][:1]
    assert lone, "expected byte-level tokens that decode to U+FFFD alone"
    inc = IncrementalText(renderer)
    pieces = [inc.add(lone) for _ in range(8)] + [inc.add(renderer.encode("ok"))]
    assert "".join(pieces).endswith("ok")
    assert sum(len(p) for p in pieces[:8]) >= 5  # streamed before the reply ended


def conversation(turns: int, system: bool = True, tools: bool = False) -> list[dict]:
    msgs = [{"role": "system", "content": "be brief"}] if system else []
    for t in range(turns):
        msgs.append({"role": "user", "content": f"step {t}"})
        if tools and t % 2:
            msgs.append({"role": "assistant", "content": "",
                         "tool_calls": [{"id": f"c{t}", "type": "function",
                                         "function": {"name": "f", "arguments": "{\"x\": 1}"}}]})
            msgs.append({"role": "tool", "tool_call_id": f"c{t}", "content": "42"})
        msgs.append({"role": "assistant", "content": f"done {t}"})
    return msgs


@pytest.mark.parametrize("system,tools", [(True, False), (False, False), (True, True)])
def test_the_short_history_adds_what_the_whole_history_adds(renderer, system, tools):
    from services.trajectory.rendering import short_history

    spec = [{"type": "function", "function": {"name": "f", "parameters": {}}}] if tools else []
    for n in range(1, 7):
        history = conversation(n, system, tools)
        new = [{"role": "user", "content": "next"}]
        assert len(short_history(history)) <= 4 + system
        full = renderer._added_by_full(history, new, spec)
        assert full is not None and renderer._added_by_full(short_history(history), new, spec) == full
        assert renderer.continuation(history, new, spec, True) == renderer.encode(full)


def test_a_template_that_depends_on_more_than_the_end_is_rendered_whole(tiny_model):
    """A template that numbers its messages adds different text after a short history: the first
    check finds it, and that shape of conversation is rendered whole from then on."""
    numbering = Renderer.from_pretrained(str(tiny_model))
    numbering.tok.chat_template = ("{% for m in messages %}[{{ loop.index }}]{{ m.role }}: {{ m.content }}"
                                   "{{ eos_token if m.role == 'assistant' else '' }}\n{% endfor %}"
                                   "{% if add_generation_prompt %}[{{ messages | length + 1 }}]assistant: {% endif %}")
    history, new = conversation(4), [{"role": "user", "content": "next"}]
    whole = numbering._added_by_full(history, new, [])
    assert numbering.continuation(history, new, [], True) == numbering.encode(whole)
    assert False in numbering._shapes.values()
    assert numbering.continuation(history, new, [], True) == numbering.encode(whole)  # still whole


def test_incremental_text_equals_decoding_everything_at_once(renderer):
    import random

    rng = random.Random(0)
    text = "héllo wörld, ünïcödé → ✓ and plain ascii; " * 3
    ids = renderer.encode(text) + [renderer.eos_id]
    lone = [i for i in range(len(renderer.tok)) if renderer.tok.decode([i]) == "\ufffd"][:2]
    ids = ids[:10] + lone + ids[10:]
    for _ in range(5):
        inc, k, pieces = IncrementalText(renderer), 0, []
        while k < len(ids):
            n = rng.randint(1, 3)
            pieces.append(inc.add(ids[k:k + n]))
            k += n
        assert "".join(pieces) == inc.text == renderer.decode(ids) == inc.final()


def test_the_rust_tokenizer_called_directly_gives_what_transformers_gives(renderer):
    assert renderer._backend is not None  # the tiny model's tokenizer is a fast one
    texts = [renderer.render(conversation(3, tools=True), [], gen=True), "héllo wörld ✓ 12345", "",
             f"a{renderer.eos_text}b  \n\t x", "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        ids = renderer.encode(text)
        assert ids == renderer.tok.encode(text, add_special_tokens=False)
        assert renderer.decode_all(ids) == renderer.tok.decode(ids, skip_special_tokens=False)
