"""The tool agent written with the OpenAI Agents SDK (`openai-agents`), pointed at the gateway
unchanged: a framework nobody here wrote, whose turns still become token-exact trajectories.

    SF_BASE_URL=http://127.0.0.1:8000/v1 SF_API_KEY=<key> .venv/bin/python examples/openai_agents_sdk.py

The agent uses the SDK's default model class, which speaks the Responses API (/v1/responses);
only the client's base_url and api_key point elsewhere. (`OpenAIChatCompletionsModel`, which
speaks chat completions, works as well.)
"""

import asyncio
import os

import httpx
from agents import Agent, ModelSettings, Runner, function_tool, set_default_openai_client, set_tracing_disabled
from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError
from openai import AsyncOpenAI

base = os.environ.get("SF_BASE_URL", "http://127.0.0.1:8000/v1")
user = {"Authorization": f"Bearer {os.environ['SF_API_KEY']}"}
set_tracing_disabled(True)  # the SDK would upload traces to OpenAI otherwise


@function_tool
def calculator(a: float, b: float, op: str) -> str:
    """Apply op (one of + - * /) to a and b."""
    return str({"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else float("nan")}.get(op, "unknown op"))


async def main() -> None:
    session = httpx.post(f"{base}/sessions", headers=user, json={"group_id": "agents-sdk"}).json()
    client = AsyncOpenAI(base_url=base, api_key=session["api_key"])
    set_default_openai_client(client, use_for_tracing=False)
    name = (await client.models.list()).data[0].id
    agent = Agent(name="calc", instructions="Use the calculator tool, then answer with the number only.",
                  model=name, model_settings=ModelSettings(max_tokens=48), tools=[calculator])
    try:
        answer = str((await Runner.run(agent, "What is 17 * 23?", max_turns=3)).final_output).strip()
    except MaxTurnsExceeded:  # a small untrained model may keep calling tools
        answer = ""
    except ModelBehaviorError:  # ... or run out of max_tokens: the SDK refuses an incomplete response
        answer = ""
    reward = 1.0 if answer == "391" else 0.0
    httpx.post(f"{base}/sessions/{session['id']}/finish", headers=user, json={"reward": reward}).raise_for_status()
    print(f"session {session['id']}: answer {answer!r}, reward {reward}")


if __name__ == "__main__":
    asyncio.run(main())
