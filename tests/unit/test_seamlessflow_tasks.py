"""The built-in tasks: prompts, the calculator tool, rewards, and the calc agent's two turns
against a fake chat endpoint (the code under test stays real; only the HTTP edge is faked)."""

from __future__ import annotations

import asyncio
import json
import random
import re

import httpx
import openai
import pytest

from seamlessflow.demo.rl import calc_agent, reverse_agent
from seamlessflow.demo.tasks import (CALCULATOR_TOOL, TASKS, CalcLevel, answer_reward, calc_prompt, calc_tool_call_text, calculate,
                                calculator_call, reverse_prompt)
from shared.toolcalls import parse


def test_reverse_prompt_and_reward():
    task, target = reverse_prompt(random.Random(0))
    assert task == f"reverse {target[::-1]}"
    assert answer_reward(target, target) == 1.0
    assert answer_reward("", target) == 0.0
    assert answer_reward("12", "13") == 0.25  # half the positions, not exact
    assert answer_reward("1234", "12") == 0.25  # too long: positions scaled by length


def test_calc_prompt_is_deterministic_and_answerable():
    a, b = calc_prompt(random.Random(7)), calc_prompt(random.Random(7))
    assert a == b
    question, expression, answer = a
    assert question == f"what is {expression}?" and answer == str(eval(expression))  # noqa: S307 - digits and one op
    assert set(TASKS) == {"reverse", "calc"}


def test_calc_level_sets_operands_operators_and_hint():
    rng = random.Random(3)
    level = CalcLevel(max_operand=9, ops="+-", hint="Use the calculator tool.")
    for _ in range(50):
        question, expression, answer = calc_prompt(rng, level)
        a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)", expression).groups()
        assert 2 <= int(a) <= 9 and 2 <= int(b) <= 9 and op in "+-"
        assert question == f"what is {expression}? Use the calculator tool." and answer == calculate(expression)
    assert calc_prompt(random.Random(7), CalcLevel()) == calc_prompt(random.Random(7))  # the default: the demo's


def test_calculator_evaluates_arithmetic_only():
    assert calculate("37*48") == "1776"
    assert calculate("(2+3)*-4") == "-20"
    assert calculate("2**10") == "error"  # no power: bounded work
    assert calculate("__import__('os')") == "error"
    assert calculate("1/2") == "error"
    assert calculate("x") == "error"
    assert calculate("1" * 100) == "error"
    assert calculator_call('{"expression": "3-5"}') == "-2"
    assert calculator_call("not json") == "error"
    assert calculator_call('{"expr": "3"}') == "error"


def test_tool_call_text_parses_back_as_one_calculator_call():
    content, calls = parse(calc_tool_call_text("12+30"), "r1")
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("calculator", {"expression": "12+30"})]


def _completion(content: str | None, tool_args: str | None, versions: list[int]) -> dict:
    msg: dict = {"role": "assistant", "content": content}
    if tool_args is not None:
        msg["tool_calls"] = [{"id": "call_1", "type": "function",
                              "function": {"name": "calculator", "arguments": tool_args}}]
    return {"id": "c", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": msg, "finish_reason": "tool_calls" if tool_args else "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
            "seamlessflow": {"versions": versions}}


def _client(replies: list[dict], seen: list[dict]) -> openai.AsyncOpenAI:
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json=replies[len(seen) - 1])

    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return openai.AsyncOpenAI(base_url="http://gw/v1", api_key="k", http_client=http, max_retries=0)


def test_calc_agent_calls_the_tool_then_answers():
    seen: list[dict] = []
    client = _client([_completion(None, '{"expression": "6*7"}', [3]), _completion("42", None, [4])], seen)
    ep = asyncio.run(calc_agent(client, "what is 6*7?", "42", 40))
    assert ep.reward == 1.0 and ep.versions == [3, 4] and ep.tokens == 6 and ep.tool_calls == 1
    assert seen[0]["tools"] == [CALCULATOR_TOOL]
    second = seen[1]["messages"]
    assert [m["role"] for m in second] == ["user", "assistant", "tool"]
    assert second[1]["tool_calls"][0]["function"]["arguments"] == '{"expression": "6*7"}'
    assert second[2] == {"role": "tool", "tool_call_id": "call_1", "content": "42"}


def test_calc_agent_scores_a_direct_answer_and_an_endless_tool_loop():
    client = _client([_completion("41", None, [1])], [])
    assert asyncio.run(calc_agent(client, "what is 6*7?", "42", 40)).reward == pytest.approx(0.6 * 0.25)
    loop = _completion(None, '{"expression": "6*7"}', [1])
    ep = asyncio.run(calc_agent(_client([loop, loop], []), "what is 6*7?", "42", 40))
    assert ep.reward == 0.0 and ep.tool_calls == 2


def test_reverse_agent_one_turn():
    seen: list[dict] = []
    ep = asyncio.run(reverse_agent(_client([_completion("321", None, [0])], seen), "reverse 123", "321", 8))
    assert ep.reward == 1.0 and seen[0]["max_tokens"] == 8 and "tools" not in seen[0]


def test_reverse_reward_shapings():
    from seamlessflow.demo.tasks import REVERSE_SHAPINGS

    pos, edit, exact = (REVERSE_SHAPINGS[k] for k in ("position", "edit", "exact"))
    assert pos("4321", "4321") == edit("4321", "4321") == exact("4321", "4321") == 1.0
    assert pos("4320", "4321") == 0.75 and exact("4320", "4321") == 0.0
    # a dropped digit shifts every later one: no position credit, but edit distance 1
    assert pos("421", "4321") == 0.25 and edit("421", "4321") == 0.75
    assert pos("43210000", "4321") == 0.5  # an over-long answer is scaled down
    assert pos("", "4321") == 0.0 and edit("", "4321") == 0.0


def test_uniform_groups_counts_groups_with_all_equal_rewards():
    from seamlessflow.demo.rl import uniform_groups

    assert uniform_groups([1, 1, 0, 1, 0.5, 0.5], 2) == 2
    assert uniform_groups([0.2, 0.3, 0.2, 0.3], 4) == 0


def test_calc_reward_checks_the_tool_result_and_ranks_malformed_calls_below_well_formed():
    from seamlessflow.demo.tasks import calc_reward

    assert calc_reward("42", "42", ["42"]) == pytest.approx(1.0)  # right call, result copied
    assert calc_reward("42", "42", []) == pytest.approx(0.6)  # right, without the tool
    # the same answer after a malformed call scores below a well-formed one
    for answer in ("42", "41", "x"):
        assert calc_reward(answer, "42", ["error"]) < calc_reward(answer, "42", ["42"])
        assert calc_reward(answer, "42", ["error"]) > calc_reward(answer, "42", [])
    # a wrong expression: copying its result earns the copy credit, not the correctness
    assert calc_reward("40", "42", ["40"]) == pytest.approx(0.2 + 0.2 + 0.6 * answer_reward("40", "42"))
    assert calc_reward("40", "42", ["40"]) < calc_reward("42", "42", ["42"])


def test_calc_agent_malformed_call_scores_below_a_well_formed_one():
    bad = _completion(None, '{"expr": "6*7"}', [1])
    ep = asyncio.run(calc_agent(_client([bad, _completion("42", None, [2])], []), "what is 6*7?", "42", 40))
    assert ep.reward == pytest.approx(0.7) and ep.exact


def test_demo_takes_the_tasks_recipe_unless_told():
    """`seamlessflow demo` runs reverse at 16 prompts x 8 samples a round with lr 2e-4, advantages
    not divided by the group's std, KL 0.01 and a 10-step warm-up (issue 26's five-seed screens) and
    calc at its own; an explicit --groups / --group-size wins."""
    import argparse

    from seamlessflow.cli import _demo_args, demo_plan
    from seamlessflow.demo.rl import TASK_RECIPES, trainer_settings

    p = argparse.ArgumentParser()
    _demo_args(p)
    reverse = demo_plan(p.parse_args([]))
    assert (reverse.task, reverse.groups, reverse.group_size) == ("reverse", 16, 8)
    calc = demo_plan(p.parse_args(["--task", "calc"]))
    assert (calc.groups, calc.group_size) == (TASK_RECIPES["calc"].groups, TASK_RECIPES["calc"].group_size)
    told = p.parse_args(["--groups", "2", "--group-size", "4"])
    assert (demo_plan(told).groups, demo_plan(told).group_size, told.groups) == (2, 4, 2)
    reverse, calc = trainer_settings(TASK_RECIPES["reverse"]), trainer_settings(TASK_RECIPES["calc"])
    assert reverse["lr"] == 2e-4 and calc["lr"] == 1e-4 and reverse["drop_uniform_groups"] is True
    assert reverse["std_normalize"] is False and calc["std_normalize"] is True
    # reverse: a KL term towards the warm start and a 10-step warm-up (session 26's five seeds)
    assert (reverse["kl_coef"], reverse["lr_warmup_steps"]) == (0.01, 10) and "kl_coef" not in calc


def test_demo_takes_the_lora_lr_when_the_trainer_trains_an_adapter():
    """With SF_TRAINER_LORA_RANK > 0 the demo's trainer runs at the task's LoRA lr (reverse: 2e-3,
    10x the full fine-tune's, issue 27); a task with none keeps its lr. The demo's settings win over
    SF_TRAINER_LR, so the choice has to be made here."""
    from seamlessflow.demo.rl import TASK_RECIPES, lora_on, trainer_settings

    assert lora_on({"SF_TRAINER_LORA_RANK": "8"}) and not lora_on({"SF_TRAINER_LORA_RANK": "0"})
    assert not lora_on({}) and not lora_on({"SF_TRAINER_LORA_RANK": " "})
    assert trainer_settings(TASK_RECIPES["reverse"], lora=True)["lr"] == 2e-3
    assert trainer_settings(TASK_RECIPES["reverse"], lora=False)["lr"] == 2e-4
    assert trainer_settings(TASK_RECIPES["calc"], lora=True)["lr"] == 1e-4


def test_demo_report_names_the_lora_settings():
    """The report's settings table says a run trained an adapter (rank, targets, ...); a full
    fine-tune's lists none, even with other LoRA variables left set."""
    from seamlessflow.demo.rl import lora_report_settings

    env = {"SF_TRAINER_LORA_RANK": "8", "SF_TRAINER_LORA_TARGETS": "all", "SF_TRAINER_LR": "1", "PATH": "/bin"}
    assert lora_report_settings(env) == {"trainer lora_rank": "8", "trainer lora_targets": "all"}
    assert lora_report_settings({"SF_TRAINER_LORA_RANK": "0", "SF_TRAINER_LORA_TARGETS": "all"}) == {}
    assert lora_report_settings({}) == {}


def test_a_trainer_setting_the_caller_sets_wins_over_the_recipe():
    """SF_TRAINER_<NAME> in the caller's environment replaces the recipe's value or adds one it has
    none of (and so reaches the report); LoRA's variables and the round's shape are not taken."""
    from seamlessflow.demo.rl import TASK_RECIPES, caller_settings, trainer_settings

    env = {"SF_TRAINER_KL_COEF": "0.01", "SF_TRAINER_LR_WARMUP_STEPS": " 10 ", "SF_TRAINER_LORA_RANK": "8",
           "SF_TRAINER_GROUP_SIZE": "4", "SF_TRAINERX": "1", "PATH": "/bin"}
    assert caller_settings(env) == {"kl_coef": "0.01", "lr_warmup_steps": "10"}
    settings = trainer_settings(TASK_RECIPES["reverse"]) | caller_settings(env)
    assert settings["lr_warmup_steps"] == "10" and settings["kl_coef"] == "0.01" and settings["lr"] == 2e-4
    assert caller_settings({"PATH": "/bin"}) == {}


def test_demo_rollout_worker_batches_a_whole_round(tmp_path, monkeypatch):
    """The demo's vLLM engine takes a round's sessions in one batch (issue 26: at the old 16, the
    reverse recipe's 128 sessions decoded in 8 waves): max_num_seqs = groups x group_size, capped,
    reaches the rollout worker's environment; --max-num-seqs wins; `up` keeps its 16."""
    import argparse

    from seamlessflow import cli
    from seamlessflow.demo.rl import MAX_DEMO_SEQS, demo_max_num_seqs
    from seamlessflow.stack import Stack

    assert (demo_max_num_seqs(8, 16), demo_max_num_seqs(4, 8), demo_max_num_seqs(64, 64)) == (128, 32, MAX_DEMO_SEQS)
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")

    def demo_opts(*argv):
        p = argparse.ArgumentParser()
        cli._demo_args(p)
        a = p.parse_args(["--model", str(model), "--data-dir", str(tmp_path / "var"), *argv])
        cli.demo_plan(a)
        return a, cli._stack_options(a)

    a, opts = demo_opts()
    assert opts.max_num_seqs == 128 and "--max-num-seqs" not in cli._demo_command(a)
    seen = {}
    monkeypatch.setattr(Stack, "_spawn", lambda self, name, argv, env, **k: seen.update(env))
    Stack(opts).spawn_rollout("rollout-0")
    assert seen["SF_ROLLOUT_MAX_NUM_SEQS"] == "128"
    assert demo_opts("--task", "calc")[1].max_num_seqs == 32
    a, opts = demo_opts("--max-num-seqs", "24")
    assert opts.max_num_seqs == 24 and "--max-num-seqs 24" in cli._demo_command(a)
    assert a.max_staleness == 2 and "--max-staleness" not in cli._demo_command(a)
    assert "--max-staleness 1" in cli._demo_command(demo_opts("--max-staleness", "1")[0])
    p = argparse.ArgumentParser()
    cli._up_args(p)
    up = p.parse_args(["--model", str(model)])
    assert cli._stack_options(up).max_num_seqs == 16 and not hasattr(up, "max_staleness")  # a demo flag only


def test_demo_agents_share_one_connection_pool_each_with_its_own_key():
    """The demo's agents share one HTTP pool (the SDK's default builds an SSL context per client,
    ~40 ms of CPU: seconds of every 128-session round, issue 26): each still sends its session's
    own key, and no agent closes the shared pool."""
    from seamlessflow.demo.rl import one_agent

    keys = []

    def answer(request: httpx.Request) -> httpx.Response:
        keys.append(request.headers["authorization"])
        return httpx.Response(200, json={
            "id": "c", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                         "message": {"role": "assistant", "content": "21"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})

    async def main() -> list:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as pool:
            eps = await asyncio.gather(*(one_agent("http://gw/v1", f"sk-{i}", "reverse", "reverse 12", "21", 8, pool)
                                         for i in range(3)))
            assert not pool.is_closed
            return eps

    eps = asyncio.run(main())
    assert sorted(keys) == ["Bearer sk-0", "Bearer sk-1", "Bearer sk-2"]
    assert [e.reward for e in eps] == [1.0, 1.0, 1.0]
