"""bench/probe_learning.py's calc task: the demo's two-turn calculator session run offline (the first
turn, the tool's result in the template's glue, the second turn), its token-exact Sample and reward.
(The probe's runs are not in the suite: they take minutes.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

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
    s = probe.CalcSession(prompt=[1, 2, 3], first=[4, 5], first_lp=[-0.1, -0.2], glue=[6, 7], second=[8, 9],
                          second_lp=[-0.5, -0.6], answer="10", results=["10"])
    sample = s.sample(version=7)
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

    def scripted(model, rows, do_sample, max_new, eos, pad):
        seen.append(rows)
        return turns[len(seen)], [[-1.0] * len(t) for t in turns[len(seen)]]

    monkeypatch.setattr(probe, "sample_shared", scripted)
    called, plain = probe.calc_sessions(None, tok, ["what is 6*7?", "what is 6*7?"], True, 64)
    assert called.results == ["42"] and called.answer == "The result is 42" and called.finished
    assert seen[1] == [called.prompt + called.first + called.glue]  # only the caller takes a second turn
    assert plain.results == [] and plain.answer == "41" and plain.second == []
    assert called.reward("42") > plain.reward("42")
    assert probe.lenient_correct(called.answer, "42") and called.answer != "42"


@pytest.fixture(scope="module")
def model(tiny_model):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def _rows(tok):
    return [probe._prompt_ids(tok, q, [probe.CALCULATOR_TOOL]) for q in ("what is 6*7?", "what is 12+345?", "what is 9-8?")]


def test_sample_shared_decodes_each_row_as_if_alone(model, tok):
    rows = _rows(tok)
    eos = tok.eos_token_id
    turns, lps = probe.sample_shared(model, rows, False, 6, eos, tok.pad_token_id)
    for row, turn, lp in zip(rows, turns, lps):
        alone = model.generate(torch.tensor([row]), do_sample=False, max_new_tokens=6, eos_token_id=eos,
                               pad_token_id=tok.pad_token_id)[0, len(row):].tolist()
        assert turn == alone[: alone.index(eos) + 1] if eos in alone else turn == alone
        full = probe.token_logprobs(model(input_ids=torch.tensor([row + turn])).logits[:, len(row) - 1:-1],
                                    torch.tensor([turn]), False)[0][0]
        assert torch.allclose(torch.tensor(lp), full, atol=1e-4)


def test_shared_prefix_logp_is_the_full_forwards_where_the_loss_reads_it(model, tok):
    from services.trainer.batching import Row, collate
    from shared.messages.trajectory import Sample

    rows = _rows(tok)
    seqs = [r + [5, 6, 7][: k + 1] for k, r in enumerate(rows)]
    masks = [[0] * len(r) + [1] * (len(s) - len(r)) for r, s in zip(rows, seqs)]
    mb = collate([Row(Sample(s, m, [0.0] * len(s), [0 if x else -1 for x in m]), 1.0, k)
                  for k, (s, m) in enumerate(zip(seqs, masks))], tok.pad_token_id)
    full, full_ent = probe.token_logprobs(model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits,
                                          mb.targets, True)
    logp, ent = probe.shared_prefix_logp(model, mb, True)
    on = mb.loss_mask > 0
    assert probe.common_prefix_len(mb.input_ids.tolist()) >= 16
    assert torch.allclose(logp[on], full[on], atol=1e-4) and torch.allclose(ent[on], full_ent[on], atol=1e-4)


def test_the_lenient_reward_credits_the_right_number_in_prose_below_the_bare_number():
    lenient = probe.calc_lenient_reward
    assert lenient("2 + 3 = 5", "5", []) == pytest.approx(0.3)  # the task's reward: ~0
    assert lenient("5", "5", []) == calc_reward("5", "5", []) == pytest.approx(0.6)
    assert lenient("2 + 3 = 6", "5", []) == calc_reward("2 + 3 = 6", "5", [])
    assert lenient("5", "5", ["5"]) == pytest.approx(1.0)


def _split_turns(ids, mask):
    """The trained runs of an SFT example (mask 1): its assistant turns, in order."""
    turns, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            turns.append(cur)
            cur = []
    return turns + ([cur] if cur else [])


@pytest.mark.parametrize("template", ["tiny", "smollm2"])
def test_calc_sft_examples_are_the_tokens_the_probe_parses_and_the_reward_scores_1(tiny_model, template, monkeypatch):
    """An SFT example (warmstart.sft_example at a CalcLevel), replayed through the probe's calc_sessions
    as the model's own turns, is the same token path (prompt, call turn, the template's tool glue, the
    answer), calls the tool once with the question's expression and scores the task's reward 1.0, exact.
    The tiny model's template renders the call as tasks.calc_tool_call_text (the demo's warm start is
    unchanged); SmolLM2's (rendered with the tiny tokenizer: no weights here) as its own Hermes text."""
    import random

    from transformers import AutoTokenizer

    from seamlessflow import smollm2
    from seamlessflow.demo.tasks import CalcLevel, calc_prompt
    from seamlessflow.demo.warmstart import calc_call_text, sft_example

    tok = AutoTokenizer.from_pretrained(tiny_model)
    if template == "smollm2":
        tok.chat_template = smollm2.CHAT_TEMPLATE
        assert calc_call_text(tok, "6*7") == '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
    else:
        assert calc_call_text(tok, "6*7") == calc_tool_call_text("6*7")
    level = CalcLevel(9, "+-", "Answer with the number only.")
    for seed in range(4):
        question, expression, answer = calc_prompt(random.Random(seed), level)
        ids, mask = sft_example(tok, "calc", random.Random(seed), level)
        first, second = _split_turns(ids, mask)
        assert tok.decode(second[:-1]) == answer and first[-1] == second[-1] == tok.eos_token_id
        scripted = iter([[first], [second]])
        monkeypatch.setattr(probe, "sample_shared", lambda *a, _t=scripted: (t := next(_t), [[0.0] * len(t[0])]))
        (s,) = probe.calc_sessions(None, tok, [question], True, 64)
        assert s.prompt + s.first + s.glue + s.second == ids
        assert s.sample(0).loss_mask == mask
        assert s.results == [answer] and s.answer == answer and s.finished
        assert s.reward(answer) == pytest.approx(1.0)
        assert expression in tok.decode(first)


def test_sft_before_rl_trains_the_start_and_leaves_the_eval_questions_out(tiny_model, monkeypatch):
    """--sft-steps: the probe's supervised warm start runs before RL (the losses reported, the KL
    reference reset to the SFT'd model) and never trains on a question its evals ask."""
    from seamlessflow.demo import warmstart

    seen = []
    real = warmstart.sft_example

    def spy(tok, task, rng, level):
        state = rng.getstate()
        seen.append(probe.calc_prompt(rng, level)[0])
        rng.setstate(state)
        return real(tok, task, rng, level)

    monkeypatch.setattr(warmstart, "sft_example", spy)
    res = probe.run({"model": str(tiny_model), "task": "calc", "steps": 1, "groups_per_step": 1, "group_size": 2,
                     "eval_every": 1, "eval_n": 8, "eval_modes": "greedy", "max_new": 4, "calc_max_operand": 5,
                     "sft_steps": 3, "sft_batch": 4, "sft_lr": 1e-3, "kl_coef": 0.1, "quiet": True})
    assert res["sft"]["steps"] == 3 and len(res["sft"]["loss"]) == 3
    held = {q for q, _ in probe.Evaluator(None, 8, task="calc", level=probe.CalcLevel(5)).tasks}
    assert len(seen) == 12 and not held & set(seen)
    assert len(res["batch_distinct"]) == 1 and "greedy_distinct" in res["eval"]["0"]


def test_a_time_budget_stops_rl_before_it_and_evaluates_where_it_stopped(tiny_model, monkeypatch):
    """--time-budget-s: no step starts once the last step's time would carry the run past the budget; the
    run then evaluates where it stopped (outside the budget) and reports its steps and wall."""
    now = [0.0]
    real_rollout = probe.rollout

    def rollout(*a):  # every step takes 10 s of the (fake) clock; nothing else does
        now[0] += 10
        return real_rollout(*a)

    monkeypatch.setattr(probe, "rollout", rollout)
    monkeypatch.setattr(probe.time, "perf_counter", lambda: now[0])
    res = probe.run({"model": str(tiny_model), "task": "calc", "steps": 50, "groups_per_step": 1, "group_size": 2,
                     "eval_every": 100, "eval_n": 4, "eval_modes": "greedy", "max_new": 4, "calc_max_operand": 5,
                     "time_budget_s": 60.0, "quiet": True})
    assert res["steps_run"] == 6 and res["rl_wall_s"] == 60  # a 7th step would have ended at 70 s
    assert str(res["steps_run"]) in res["eval"] and len(res["batch_exact"]) == res["steps_run"]
