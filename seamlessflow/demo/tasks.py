"""Built-in verifiable tasks for demos and learning tests (pure: no model, no sockets).

reverse: "reverse 4821" -> "1284", one turn.
calc:    "what is 37*48?" -> the agent calls the `calculator` tool through an OpenAI tool
         call, reads the result in a second turn and answers "1776".

Both score the final answer with answer_reward: 0.5 * (fraction of positions right) + 0.5 * exact;
calc adds credit for a well-formed tool call and for copying the tool's actual result (calc_reward).
The agents that run these tasks through the gateway live in seamlessflow/demo/rl.py; the warm
start that teaches their format lives in seamlessflow/demo/warmstart.py.
"""

from __future__ import annotations

import ast
import json
import operator
import random
from dataclasses import dataclass
from typing import Callable


def answer_reward(answer: str, target: str) -> float:
    answer = answer.strip()
    right = sum(a == b for a, b in zip(answer, target)) / len(target)
    if len(answer) > len(target):
        right *= len(target) / len(answer)
    return 0.5 * right + 0.5 * float(answer == target)


# -- reverse ----------------------------------------------------------------------------------------

def reverse_prompt(rng: random.Random, min_len: int = 3, max_len: int = 5) -> tuple[str, str]:
    digits = "".join(rng.choices("0123456789", k=rng.randint(min_len, max_len)))
    return f"reverse {digits}", digits[::-1]


def reverse_reward(answer: str, target: str) -> float:
    return answer_reward(answer, target)


def position_reward(answer: str, target: str) -> float:
    """Only the dense part: the fraction of positions right (an over-long answer scaled down)."""
    answer = answer.strip()
    right = sum(a == b for a, b in zip(answer, target)) / len(target)
    return right * min(1.0, len(target) / len(answer)) if answer else 0.0


def edit_reward(answer: str, target: str) -> float:
    """1 - Levenshtein distance / the longer length: partial credit that survives a shifted digit."""
    answer = answer.strip()
    prev = list(range(len(target) + 1))
    for i, a in enumerate(answer, 1):
        cur = [i]
        for j, b in enumerate(target, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a != b)))
        prev = cur
    return 1.0 - prev[-1] / max(len(answer), len(target))


def exact_reward(answer: str, target: str) -> float:
    return float(answer.strip() == target)


# reward shapings of the reverse task that the probe (bench/probe_learning.py) compares
REVERSE_SHAPINGS = {"answer": answer_reward, "position": position_reward, "edit": edit_reward,
                    "exact": exact_reward}


# -- calc -------------------------------------------------------------------------------------------

# Key order as the gateway forwards it (services/gateway/schemas.py FunctionDef), so the warm
# start renders the same system prompt the agents' requests do.
CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


@dataclass(frozen=True)
class CalcLevel:
    """calc's difficulty: operands 2..max_operand, the operators drawn from `ops`, and an instruction
    appended to the question (`hint`). The default is the demo's task. A pretrained chat model can sit
    at 0 on it: the 4-bit SmolLM2-135M never calls the tool and never answers with the bare number
    (docs/history/benchmarks-log.md, "SmolLM2 on calc"), so RL has nothing to compare; a hint or
    smaller numbers give it a reward above 0 to start from."""

    max_operand: int = 99
    ops: str = "+-*"
    hint: str = ""


def calc_prompt(rng: random.Random, level: CalcLevel = CalcLevel()) -> tuple[str, str, str]:
    """(question, expression, answer): two numbers 2..level.max_operand (2-99) and one of level.ops
    (+ - *); the same draws as before for the default level."""
    a, b = rng.randint(2, level.max_operand), rng.randint(2, level.max_operand)
    op = rng.choice(level.ops)
    expression = f"{a}{op}{b}"
    question = f"what is {expression}?" + (f" {level.hint}" if level.hint else "")
    return question, expression, calculate(expression)


def calculate(expression: str) -> str:
    """The calculator tool: integers with + - * and parentheses; anything else is "error"
    (it never evaluates names, calls or attributes)."""

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if abs(left) > 10**9 or abs(right) > 10**9:
                raise ValueError("too large")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError("unsupported")

    if len(expression) > 64:
        return "error"
    try:
        return str(ev(ast.parse(expression.strip(), mode="eval").body))
    except (SyntaxError, ValueError, RecursionError):
        return "error"


def calculator_call(arguments: str) -> str:
    """Run the tool on an OpenAI tool call's `arguments` (a JSON string)."""
    try:
        args = json.loads(arguments)
    except ValueError:
        return "error"
    expression = args.get("expression") if isinstance(args, dict) else None
    return calculate(expression) if isinstance(expression, str) else "error"


# calc's reward, shaped (docs/guide: "The calc reward"): correctness dominates, and two smaller terms
# give GRPO groups something to compare before any answer is right (the warm start leaves most
# answers wrong, and an all-zero group teaches nothing):
CALC_CALL_WELL_FORMED = 0.2  # the call parsed and the tool ran (its result is not "error")
CALC_CALL_MALFORMED = 0.1  # a call was made but the tool could not run it: below a well-formed one
CALC_COPY = 0.2  # the answer repeats what the tool actually returned (a well-formed call only)
CALC_CORRECT = 0.6  # the answer checked against the true result (answer_reward's partial credit)


def calc_reward(answer: str, target: str, tool_results: list[str]) -> float:
    """The calc session's reward from its final answer, the true result and what the tool actually
    returned in this session (empty: no call). A malformed call scores below a well-formed one with
    the same answer; a right call whose result is copied scores 1.0."""
    correct = CALC_CORRECT * answer_reward(answer, target)
    if not tool_results:
        return correct
    result = tool_results[-1]
    if result == "error":
        return CALC_CALL_MALFORMED + correct
    return CALC_CALL_WELL_FORMED + CALC_COPY * answer_reward(answer, result) + correct


def calc_tool_call_text(expression: str) -> str:
    """What the model writes to call the tool: the format the chat template renders and
    shared/toolcalls.py parses (arguments as json.dumps writes them)."""
    return '<tool_call>{"name": "calculator", "arguments": ' + json.dumps({"expression": expression}) + "}</tool_call>"


# -- registry ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TaskSpec:
    name: str
    max_tokens: int  # per turn
    problem: Callable[[random.Random], tuple[str, str]]  # rng -> (prompt, target)


def _calc_problem(rng: random.Random) -> tuple[str, str]:
    question, _, answer = calc_prompt(rng)
    return question, answer


TASKS = {
    "reverse": TaskSpec("reverse", 8, reverse_prompt),
    # the tool call is ~25 tokens on the demo tokenizer; the answer at most 5 digits + end of turn
    "calc": TaskSpec("calc", 40, _calc_problem),
}
