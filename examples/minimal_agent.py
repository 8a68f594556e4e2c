"""The smallest agent: one session, one turn with the plain openai SDK, one reward.

    .venv/bin/seamlessflow up        # prints the base URL and an API key
    SF_BASE_URL=http://127.0.0.1:8000/v1 SF_API_KEY=<key> .venv/bin/python examples/minimal_agent.py
"""

import os

import httpx
import openai

base = os.environ.get("SF_BASE_URL", "http://127.0.0.1:8000/v1")
user = {"Authorization": f"Bearer {os.environ['SF_API_KEY']}"}

# 1. A session has its own API key: every turn made with it lands in one trajectory.
session = httpx.post(f"{base}/sessions", headers=user, json={"group_id": "minimal"}).json()
agent = openai.OpenAI(base_url=base, api_key=session["api_key"])

# 2. The agent's own code, unchanged: only base_url and api_key point at SeamlessFlow.
model = agent.models.list().data[0].id
reply = agent.chat.completions.create(
    model=model, max_tokens=16, messages=[{"role": "user", "content": "reverse 123"}])
answer = (reply.choices[0].message.content or "").strip()

# 3. The reward finishes the session; the trainer gets its token-exact trajectory.
reward = 1.0 if answer == "321" else 0.0
httpx.post(f"{base}/sessions/{session['id']}/finish", headers=user, json={"reward": reward}).raise_for_status()
print(f"session {session['id']}: answer {answer!r}, reward {reward}")
