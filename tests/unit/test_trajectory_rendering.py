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
