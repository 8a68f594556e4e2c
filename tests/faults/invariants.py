"""The one invariant checker every fault case ends with (docs/reliability.md states them).

1. Answered: every agent call either succeeded, or failed with a clear, retryable,
   OpenAI-shaped error ({"error": {"message", "type", "code"}} with 429/502/503/504, or a
   retryable code in a stream's error event; a refused connection only while the gateway
   itself was down) while a fault lasted (from its injection to `grace` seconds after the
   system was whole again); and no call took longer than `hang_limit` seconds.
2. Consistent: every finished session's trajectory is complete (every reply an agent got is a
   turn of it, with the same text and token count) and consistent (each turn's segments
   decode to its reply; versions never decrease; token ids, loss masks, logprobs and
   versions of every sample are aligned: prompt tokens mask 0, version -1, logprob 0;
   generated tokens mask 1, a version >= 0, a finite logprob <= 0).
3. Trained once: the trainer's audit log (its surviving steps: services/trainer/audit.py)
   holds every finished session exactly once, and no session twice.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from functools import cache
from pathlib import Path

import httpx

from tests.faults.agents import Call, FaultAgents
from tests.faults.harness import Fault, FaultStack


def check(stack: FaultStack, agents: FaultAgents, faults: list[Fault], hang_limit: float, grace: float = 20.0,
          train_timeout: float = 30.0) -> dict:
    """Assert the three invariants; returns a summary for the test's own checks and its log line."""
    problems = answered(agents.calls, faults, hang_limit, grace)
    trajectories, more = consistent(stack, agents)
    problems += more
    trained, more = trained_once(stack, {s.id for s in agents.finished}, train_timeout)
    problems += more
    summary = {"calls": len(agents.calls), "ok": sum(c.ok for c in agents.calls),
               "failed": sum(not c.ok for c in agents.calls), "sessions": len(agents.sessions),
               "finished": len(agents.finished), "trained": trained,
               "slowest_s": round(max((c.seconds for c in agents.calls), default=0.0), 2)}
    assert not problems, f"{len(problems)} invariant violation(s) ({summary}):\n" + "\n".join(problems[:15])
    return summary | {"trajectories": trajectories}


# 1. -----------------------------------------------------------------------------------------------

def answered(calls: list[Call], faults: list[Fault], hang_limit: float, grace: float) -> list[str]:
    out = []
    for c in calls:
        what = f"{c.op} {c.session or '(new)'} {c.request_id} at {c.t0:.2f}-{c.t1:.2f}"
        if c.t1 == 0.0:
            out.append(f"{what}: never ended")
            continue
        if c.seconds > hang_limit:
            out.append(f"{what}: took {c.seconds:.1f}s > {hang_limit:.0f}s")
        if c.ok:
            continue
        during = [f for f in faults if c.t1 >= f.t0 and c.t0 <= f.t1 + grace]
        if not during:
            out.append(f"{what}: failed outside any fault: {c.status} {c.exc} {c.body}")
        elif c.status == 0 and c.error is None:  # no HTTP answer at all
            if not (any(f.unreachable for f in during) and c.unreachable):
                out.append(f"{what}: no answer ({c.exc}) while the gateway was up")
        elif not (_openai_shaped(c.error) and c.retryable()):
            out.append(f"{what}: not a clear retryable OpenAI error: {c.status} {c.body}")
    return out


def _openai_shaped(error: dict | None) -> bool:
    return (isinstance(error, dict) and isinstance(error.get("message"), str) and bool(error["message"])
            and isinstance(error.get("type"), str) and "code" in error)


# 2. -----------------------------------------------------------------------------------------------

@cache
def _tokenizer(model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def consistent(stack: FaultStack, agents: FaultAgents) -> tuple[dict[str, dict], list[str]]:
    """Every finished session's trajectory (GET /v1/sessions/{id}), and what is wrong with them."""
    tok = _tokenizer(stack.model)
    out, found = [], {}
    headers = {"Authorization": f"Bearer {stack.api_key}"}
    with httpx.Client(base_url=stack.gateway_url, headers=headers, timeout=30) as http:
        for s in agents.finished:
            r = http.get(f"/sessions/{s.id}")
            if r.status_code != 200:
                out.append(f"session {s.id}: GET answered {r.status_code} {r.text[:200]}")
                continue
            found[s.id] = r.json()
            out += [f"session {s.id}: {p}" for p in _session_problems(found[s.id], s.turns, tok)]
    return found, out


def _session_problems(t: dict, seen: list[Call], tok) -> list[str]:
    out = []
    if t["status"] != "finished":
        out.append(f"status {t['status']!r}, not finished")
    turns = {x["request_id"]: x for x in t["turns"]}
    for c in seen:  # complete: every reply the agent got is recorded as it got it
        turn = turns.get(c.request_id)
        if turn is None:
            out.append(f"reply to {c.request_id} is not a turn of the trajectory")
            continue
        n = sum(len(s["token_ids"]) for s in turn["segments"])
        if (turn["reply"].get("content") or "") != c.content or n != c.tokens:
            out.append(f"turn {turn['turn_id']}: recorded {n} tokens {turn['reply'].get('content')!r}, "
                       f"the agent got {c.tokens} tokens {c.content!r}")
    for turn in t["turns"]:
        segs = turn["segments"]
        ids = [i for s in segs for i in s["token_ids"]]
        if tok.decode(ids, skip_special_tokens=True) != (turn["reply"].get("content") or ""):
            out.append(f"turn {turn['turn_id']}: segments decode to {tok.decode(ids)!r}, reply is "
                       f"{turn['reply'].get('content')!r}")
        versions = [s["version"] for s in segs]
        if versions != sorted(versions):
            out.append(f"turn {turn['turn_id']}: segment versions decrease: {versions}")
        if any(len(s["token_ids"]) != len(s["logprobs"]) for s in segs):
            out.append(f"turn {turn['turn_id']}: a segment's tokens and logprobs differ in length")
    if not t["samples"]:
        out.append("no samples")
    for k, s in enumerate(t["samples"]):
        n = len(s["token_ids"])
        if not (len(s["loss_mask"]) == len(s["logprobs"]) == len(s["versions"]) == n):
            out.append(f"sample {k}: lengths differ: ids {n}, mask {len(s['loss_mask'])}, "
                       f"logprobs {len(s['logprobs'])}, versions {len(s['versions'])}")
            continue
        gen = [v for v, m in zip(s["versions"], s["loss_mask"]) if m]
        if gen != sorted(gen):
            out.append(f"sample {k}: versions of generated tokens decrease")
        for m, lp, v in zip(s["loss_mask"], s["logprobs"], s["versions"]):
            if (m and not (v >= 0 and math.isfinite(lp) and lp <= 0)) or (not m and (v != -1 or lp != 0.0)):
                out.append(f"sample {k}: misaligned token (mask {m}, logprob {lp}, version {v})")
                break
    return out


# 3. -----------------------------------------------------------------------------------------------

def trained_once(stack: FaultStack, finished: set[str], timeout: float) -> tuple[int, list[str]]:
    """Waits (up to `timeout`) for the trainer to train every finished session, then checks."""
    from services.trainer.audit import trained_steps

    deadline = time.monotonic() + timeout
    while True:
        steps = trained_steps(stack.audit())
        counts = Counter(i for ids in steps.values() for i in ids)
        missing = finished - set(counts)
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    out = [f"session {sid} was never trained (audit log {stack.audit_log})" for sid in sorted(missing)]
    out += [f"session {sid} trained {n} times" for sid, n in counts.items() if n > 1]
    return len(finished & set(counts)), out
