"""An agent with a tool: it may call `calculator` through OpenAI tool calls, reads the result in
the next turn and answers; the reward checks the final answer. One session, several turns, all
recorded token-exactly (the tool result is the only text the model did not write).

    SF_BASE_URL=http://127.0.0.1:8000/v1 SF_API_KEY=<key> .venv/bin/python examples/tool_agent.py

A small untrained model rarely calls the tool; the loop is what a real agent runs either way.
"""

import ast
import json
import operator
import os

import httpx
import openai

base = os.environ.get("SF_BASE_URL", "http://127.0.0.1:8000/v1")
user = {"Authorization": f"Bearer {os.environ['SF_API_KEY']}"}
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression with + - * /.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


def calculator(expression: str) -> str:
    """+ - * / on numbers only (never eval)."""
    def ev(node):
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        raise ValueError("only numbers and + - * /")
    try:
        return str(ev(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"


def run(question: str, truth: str, max_turns: int = 3) -> None:
    session = httpx.post(f"{base}/sessions", headers=user, json={"group_id": "calc"}).json()
    agent = openai.OpenAI(base_url=base, api_key=session["api_key"])
    model = agent.models.list().data[0].id
    messages = [{"role": "system", "content": "Use the calculator tool, then answer with the number only."},
                {"role": "user", "content": question}]
    answer, tool_calls = "", 0
    for _ in range(max_turns):
        msg = agent.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=48).choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:  # a final answer
            answer = (msg.content or "").strip()
            break
        for call in msg.tool_calls:  # run each tool and hand its result back in the next turn
            tool_calls += 1
            args = json.loads(call.function.arguments or "{}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculator(args.get("expression", ""))})
    reward = 1.0 if answer == truth else 0.0
    httpx.post(f"{base}/sessions/{session['id']}/finish", headers=user, json={"reward": reward}).raise_for_status()
    print(f"session {session['id']}: {tool_calls} tool call(s), answer {answer!r}, reward {reward}")


if __name__ == "__main__":
    run("What is 17 * 23?", "391")
