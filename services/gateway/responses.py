"""/v1/responses (the OpenAI Responses API): one turn, forwarded as a chat turn; and stored responses.

POST /v1/responses
    1. authenticate (a session key attributes the turn to its session, as for chat)
    2. decode; with previous_response_id, load that response: it must exist and belong to the
       caller (else 404)
    3. translate to the ChatRequest of a chat turn (responses_translate.py) and run it as chat.py
       runs chat turns (same liveness, cancel and resend rules), streamed or not
    4. unless `store` is false, store the response with its conversation before the agent sees
       its end (a next turn may name it at once); a user key's turns continue in the session
       of the response they name
GET /v1/responses/{id}: a stored response, to the keys of its tenant: its session's key, the user key
whose turn or session it was (else 404, as for an unknown id).

The gateway knows nothing of turns or tokens here either: the trajectory manager matches
the translated conversation to its prefix tree exactly as it matches a chat conversation.
"""

from __future__ import annotations

import uuid

from starlette.requests import Request
from starlette.responses import Response

from services.gateway import responses_format as fmt
from services.gateway import responses_translate as rt
from services.gateway.chat import Turn, claimer, collect, stream
from services.gateway.edge import JSON, ClientGone, authenticate, read_body
from services.gateway.errors import ApiError
from services.gateway.responses_schemas import ResponseCreateRequest
from services.gateway.schemas import decode
from services.gateway.service import Gateway
from services.gateway.store import KeyRecord, ResponseStore, StoredResponse
from shared.messages.chat import ChatDone


def _store(gw: Gateway) -> ResponseStore:
    return ResponseStore(gw.keys, gw.cfg.session_key_ttl)


def _usable(key: KeyRecord, record: StoredResponse | None) -> StoredResponse | None:
    """The record, if this key may use it: a session key only its own session's responses, a user
    key only its tenant's (its own turns' and its sessions'). Anything else is "not found"."""
    if record is None:
        return None
    mine = record.session_id == key.session_id if key.kind == "session" else record.owner == key.owner
    return record if mine else None


async def _previous(gw: Gateway, key: KeyRecord, response_id: str | None) -> StoredResponse | None:
    if response_id is None:
        return None
    record = _usable(key, await _store(gw).get(response_id))
    if record is None:
        # 404, where OpenAI says 400: the id is well formed, what it names does not exist (or is not
        # the caller's); a 400 would tell a schema-valid request from a bad one wrongly (schemathesis)
        raise ApiError(404, f"Previous response with id '{response_id}' not found.", "previous_response_not_found",
                       "previous_response_id")
    return record


async def create(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    # 1.-2.
    key = await authenticate(request, gw.keys, gw.limiter)
    req = decode(await read_body(request, gw.cfg.max_body_bytes), ResponseCreateRequest)
    previous = await _previous(gw, key, req.previous_response_id)
    # 3.
    session_id = key.session_id or (previous.session_id if previous else "")
    plan = rt.chat_request(req, uuid.uuid4().hex, session_id, gw.cfg, previous.conversation if previous else [])
    turn = Turn.admit(gw, "response", plan.chat, key)
    shape = fmt.Shape(turn.id, turn.created, plan.chat.model, req, session_id)

    claim = claimer(gw, key)

    async def keep(done: ChatDone, message: bool = False) -> None:  # 4.
        shape.session_id = done.session_id or session_id
        if claim is not None:
            await claim(done)
        if req.store is not False:
            record = StoredResponse(shape.session_id, done.turn_id, plan.conversation + [rt.reply_message(done)],
                                    shape.response(done, message), owner=key.owner)
            await _store(gw).put(turn.id, record)

    headers = {"x-request-id": plan.chat.request_id}
    try:
        if req.stream:
            events = fmt.EventStream(shape)
            return await stream(request, turn, events, headers, on_done=lambda done: keep(done, events.open))
        done = await collect(request, turn)
    except ClientGone:
        return Response(status_code=499)  # nobody is listening; uvicorn drops it
    except BaseException:
        turn.release()  # collect and stream release it themselves; this covers what runs before them
        raise
    await keep(done)
    return JSON(shape.response(done), headers=headers)


async def retrieve(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    key = await authenticate(request, gw.keys, gw.limiter)
    response_id = request.path_params["response_id"]
    record = _usable(key, await _store(gw).get(response_id))
    if record is None:
        raise ApiError(404, f"Response with id '{response_id}' not found.", "response_not_found")
    return JSON(record.response)
