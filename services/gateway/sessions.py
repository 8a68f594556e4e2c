"""/v1/sessions: create a session (and its API key), reward it, finish it, read its trajectory.

The trajectory manager owns sessions (sf.session.<op>); the gateway owns the keys.
A session belongs to the tenant that created it (the user key, `KeyRecord.owner`): that user key
and the session's own key may act on it. Any other session is "not found" to a key, even one that
exists, so keys cannot probe for other tenants' sessions. The trainer and the CLI read sessions
from Redis, not through here.
"""

from __future__ import annotations

import math

from starlette.requests import Request
from starlette.responses import Response

from services.gateway.edge import JSON, authenticate, read_body
from services.gateway.errors import RETRY_SOON, ApiError
from services.gateway.schemas import FinishBody, RewardBody, SessionCreate, decode
from services.gateway.service import Gateway
from services.gateway.store import KeyRecord
from shared.messages.session import SessionReply, SessionRequest

_CODES = {400: "invalid_request", 404: "session_not_found", 409: "session_conflict", 429: "admission_paused",
          503: "trajectory_unavailable"}
ADMISSION_RETRY_AFTER = "5"  # seconds; the SDK waits this long before retrying a 429 on its own


def _check(reply: SessionReply, session_id: str = "") -> SessionReply:
    if reply.status == 200:
        return reply
    default = f"session {session_id} not found" if reply.status == 404 else "session request failed"
    headers = None
    if reply.retry_after > 0:  # back-pressure (429), a finish still being published (503)
        headers = {"retry-after": str(math.ceil(reply.retry_after))}
    elif reply.status == 429:
        headers = {"retry-after": ADMISSION_RETRY_AFTER}
    elif reply.status == 503:  # Redis or NATS unreachable behind the trajectory manager: retryable
        headers = RETRY_SOON
    raise ApiError(reply.status, reply.message or default,
                   reply.code or _CODES.get(reply.status, "trajectory_error"), headers=headers)


def _not_found(session_id: str) -> ApiError:
    return ApiError(404, f"session {session_id} not found", "session_not_found")


async def _may_use(gw: Gateway, key: KeyRecord, session_id: str) -> None:
    if key.kind == "session":
        if key.session_id != session_id:
            raise _not_found(session_id)
    elif await gw.keys.session_owner(session_id) != key.owner:
        raise _not_found(session_id)


def _finite(reward: float | None) -> float | None:
    if reward is not None and not math.isfinite(reward):
        raise ApiError(400, "reward must be a finite number", "invalid_value", "reward")
    return reward


async def create(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    key = await authenticate(request, gw.keys, gw.limiter)
    if key.kind != "user":
        raise ApiError(403, "creating a session needs a user API key, not a session key", "user_key_required")
    body = decode(await read_body(request, gw.cfg.max_body_bytes), SessionCreate)
    if body.group_id and not await gw.keys.claim_group(body.group_id, key.owner):
        # another tenant's group: as if it did not exist (a 403 would confirm that it does)
        raise ApiError(404, f"group {body.group_id} not found", "group_not_found", "group_id")
    reply = _check(await gw.session(SessionRequest(
        op="create", group_id=body.group_id or "", metadata=body.metadata or {})))
    if not reply.session_id:
        raise ApiError(502, "the trajectory manager created a session without an id", "upstream_error")
    api_key = await gw.keys.add_session_key(reply.session_id, key.owner, key.limits)
    gw.session_event("created")
    # The manager's extras (e.g. policy_version) pass through; the key is shown this once.
    return JSON({**reply.body, "id": reply.session_id, "object": "session", "api_key": api_key,
                 "group_id": reply.body.get("group_id") or body.group_id or ""})


async def get(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    key = await authenticate(request, gw.keys, gw.limiter)
    session_id = request.path_params["session_id"]
    await _may_use(gw, key, session_id)
    reply = _check(await gw.session(SessionRequest(op="get", session_id=session_id)), session_id)
    return JSON(reply.body)


async def _settle(request: Request, op: str, body_type: type, status: str) -> Response:
    """reward and finish: the same checks, one op name apart."""
    gw: Gateway = request.app.state.gateway
    key = await authenticate(request, gw.keys, gw.limiter)
    session_id = request.path_params["session_id"]
    await _may_use(gw, key, session_id)
    body = decode(await read_body(request, gw.cfg.max_body_bytes), body_type)
    value = _finite(body.reward)
    reply = _check(await gw.session(SessionRequest(op=op, session_id=session_id, reward=value)), session_id)
    gw.session_event("finished" if op == "finish" else "", value)
    return JSON({"id": session_id, "status": status, "reward": value, **reply.body})


async def reward(request: Request) -> Response:
    return await _settle(request, "reward", RewardBody, "rewarded")


async def finish(request: Request) -> Response:
    return await _settle(request, "finish", FinishBody, "finished")
