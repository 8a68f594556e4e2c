"""Two agents in one reward group: a solver answers, a critic judges the solver's answer. Each has
its own session, so each gets its own token stream and trajectory; they share a group_id, so the
trainer compares them in one GRPO group.

    SF_BASE_URL=http://127.0.0.1:8000/v1 SF_API_KEY=<key> .venv/bin/python examples/two_agents.py

Two-role LoRA variant: each role trains an adapter of its own, in one run. The agent code is the
same (a session names its role in its metadata); the stack runs a LoRA trainer with one adapter
per role, and LoRA-serving rollout workers that run each session on its role's adapter:

    SF_TRAINER_LORA_RANK=8 SF_TRAINER_LORA_ROLES=solver,critic SF_TRAINER_GROUP_SIZE=2 \
    SF_ROLLOUT_LORA=1 SF_ROLLOUT_MAX_LORAS=8 .venv/bin/seamlessflow up
    SF_ROUNDS=32 SF_BASE_URL=... SF_API_KEY=<key> .venv/bin/python examples/two_agents.py

Each published version is then `v%06d/solver/` + `v%06d/critic/` (docs/architecture.md "Multi-LoRA").
"""

import os
import uuid

import httpx
import openai

base = os.environ.get("SF_BASE_URL", "http://127.0.0.1:8000/v1")
user = {"Authorization": f"Bearer {os.environ['SF_API_KEY']}"}


def session(group: str, role: str) -> tuple[str, openai.OpenAI]:
    s = httpx.post(f"{base}/sessions", headers=user, json={"group_id": group, "metadata": {"role": role}}).json()
    return s["id"], openai.OpenAI(base_url=base, api_key=s["api_key"])


def ask(agent: openai.OpenAI, prompt: str) -> str:
    model = agent.models.list().data[0].id
    reply = agent.chat.completions.create(model=model, max_tokens=16, messages=[{"role": "user", "content": prompt}])
    return (reply.choices[0].message.content or "").strip()


def finish(session_id: str, reward: float) -> None:
    httpx.post(f"{base}/sessions/{session_id}/finish", headers=user, json={"reward": reward}).raise_for_status()


def episode(digits: str) -> None:
    group = f"solve-and-judge-{uuid.uuid4().hex[:8]}"
    truth = digits[::-1]
    solver_id, solver = session(group, "solver")
    critic_id, critic = session(group, "critic")

    answer = ask(solver, f"reverse {digits}")
    verdict = ask(critic, f"Is {answer!r} the reverse of {digits}? Answer yes or no.").lower()

    correct = answer == truth
    finish(solver_id, 1.0 if correct else 0.0)  # the solver is rewarded for the right answer
    finish(critic_id, 1.0 if verdict.startswith("yes") == correct else 0.0)  # the critic for a right verdict
    print(f"group {group}: session {solver_id} (solver) answer {answer!r}; "
          f"session {critic_id} (critic) verdict {verdict!r}")


for i in range(int(os.environ.get("SF_ROUNDS", "1"))):  # one reward group (two sessions) per round
    episode("4721" if i == 0 else str(1000 + (i * 7919) % 9000))
