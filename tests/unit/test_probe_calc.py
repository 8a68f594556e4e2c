"""bench/probe_learning.py's calc task: the demo's two-turn calculator session run offline (the first
turn, the tool's result in the template's glue, the second turn), its token-exact Sample and reward.
(The probe's runs are not in the suite: they take minutes.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import bench.probe_learning as probe  # noqa: E402
from seamlessflow.demo.tasks import calc_reward, calc_tool_call_text  # noqa: E402
from seamlessflow.demo.warmstart import _tool_turn_ids  # noqa: E402


@pytest.fixture(scope="module")
def tok(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.mark.parametrize(("answer", "target", "right"), [
    ("1776", "1776", True), ("48 times 37 is 1,776.", "1776", True), ("-12", "-12", True),
    ("The answer is 12, not 13", "12", False), ("no number", "5", False), ("", "5", False)])
def test_lenient_correct_takes_the_last_integer(answer, target, right):
    assert probe.lenient_correct(answer, target) is right


def test_the_glue_is_the_templates_tool_turn_and_closes_a_cut_turn(tok):
    eos = tok.eos_token_id
    assert probe.tool_glue_ids(tok, [5, eos], ["42"]) == _tool_turn_ids(tok, "42")
    assert probe.tool_glue_ids(tok, [5, 6], ["42"]) == [eos] + _tool_turn_ids(tok, "42")


def test_a_sessions_sample_trains_both_turns_and_nothing_else():
    s = probe.CalcSession(prompt=[1, 2, 3], first=[4, 5], glue=[6, 7], second=[8, 9], answer="10", results=["10"])
    sample = s.sample([0.0, 0.0, 0.0, -0.1, -0.2, -0.3, -0.4, -0.5, -0.6], version=7)
    assert sample.token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert sample.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 1]
    assert sample.logprobs == [0.0, 0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.5, -0.6]
    assert sample.versions == [-1, -1, -1, 7, 7, -1, -1, 7, 7]
    assert s.reward("10") == 1.0
    assert probe.CalcSession([1], [2], answer="10").reward("10") == calc_reward("10", "10", [])
    assert probe.CalcSession([1], [2], results=["10"], answer="", finished=False).reward("10") == 0.0


def test_calc_sessions_run_the_tool_between_the_turns(tok, monkeypatch):
    eos = tok.eos_token_id
    enc = lambda text: tok.encode(text, add_special_tokens=False) + [eos]  # noqa: E731
    turns = {1: [enc(calc_tool_call_text("6*7")), enc("41")],  # a call, then a plain (wrong) answer
             2: [enc("The result is 42")]}
    seen = []

    def scripted(model, tok_, prompts, do_sample, max_new):
        seen.append(prompts)
        return turns[len(seen)]

    monkeypatch.setattr(probe, "generate", scripted)
    called, plain = probe.calc_sessions(None, tok, ["what is 6*7?", "what is 6*7?"], True, 64)
    assert called.results == ["42"] and called.answer == "The result is 42" and called.finished
    assert seen[1] == [called.prompt + called.first + called.glue]  # only the caller takes a second turn
    assert plain.results == [] and plain.answer == "41" and plain.second == []
    assert called.reward("42") > plain.reward("42")
    assert probe.lenient_correct(called.answer, "42") and called.answer != "42"
