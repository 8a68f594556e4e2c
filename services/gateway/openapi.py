"""/openapi.json: an OpenAPI 3.1 document generated from the Structs that decode request bodies.

Because `schemas.py` both validates bodies and feeds this document, the published
schema cannot drift from what the server accepts. Response bodies follow the
OpenAI formats and are described in prose.
"""

from __future__ import annotations

from typing import Any

import msgspec

from services.gateway import schemas
from services.gateway.responses_schemas import ResponseCreateRequest
from services.gateway.config import GatewayConfig

REF = "#/components/schemas/{name}"


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    error: ErrorDetail


def _body(name: str, required: bool = True) -> dict[str, Any]:
    return {"required": required, "content": {"application/json": {"schema": {"$ref": REF.format(name=name)}}}}


def _answers(ok: str, *errors: int, stream: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"200": {"description": ok, "content": {"application/json": {"schema": {"type": "object"}}}}}
    if stream:
        out["200"]["content"]["text/event-stream"] = {"schema": {"type": "string"}}
    reasons = {400: "invalid request", 401: "missing or wrong API key", 403: "needs a user key",
               404: "unknown model, session or response", 409: "session conflict", 413: "body too large",
               503: "NATS, Redis or the trajectory manager unavailable", 504: "no answer in time"}
    for status in errors:
        out[str(status)] = {"description": reasons[status],
                            "content": {"application/json": {"schema": {"$ref": REF.format(name="ErrorResponse")}}}}
    return out


def document(cfg: GatewayConfig) -> dict[str, Any]:
    _, components = msgspec.json.schema_components(schemas.AGENT_BODIES + (ResponseCreateRequest, ErrorResponse), ref_template=REF)
    turn = (400, 401, 404, 413, 503, 504)
    session = (400, 401, 404, 409, 413, 503, 504)
    sid = [{"name": "session_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    rid = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    return {
        "openapi": "3.1.0",
        "info": {"title": "SeamlessFlow gateway", "version": "1",
                 "description": f"OpenAI-compatible agent API serving `{cfg.model}`, with sessions and rewards."},
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
        "paths": {
            "/v1/chat/completions": {"post": {
                "operationId": "createChatCompletion", "requestBody": _body("ChatCompletionRequest"),
                "responses": _answers("chat.completion, or chat.completion.chunk events", *turn, stream=True)}},
            "/v1/completions": {"post": {
                "operationId": "createCompletion", "requestBody": _body("CompletionRequest"),
                "responses": _answers("text_completion, or its chunk events", *turn, stream=True)}},
            "/v1/responses": {"post": {
                "operationId": "createResponse", "requestBody": _body("ResponseCreateRequest"),
                "responses": _answers("response, or the Responses event stream (response.created ... "
                                      "response.completed)", *turn, stream=True)}},
            "/v1/responses/{response_id}": {"get": {
                "operationId": "getResponse", "parameters": rid,
                "responses": _answers("a stored response", 401, 404, 503)}},
            "/v1/models": {"get": {"operationId": "listModels", "responses": _answers("the served model", 401)}},
            "/v1/sessions": {"post": {
                "operationId": "createSession", "requestBody": _body("SessionCreate", required=False),
                "responses": _answers("{id, api_key, group_id}; the key is shown once", 400, 401, 403, 503, 504)}},
            "/v1/sessions/{session_id}": {"get": {
                "operationId": "getSession", "parameters": sid,
                "responses": _answers("the session's trajectory", 401, 404, 503, 504)}},
            "/v1/sessions/{session_id}/reward": {"post": {
                "operationId": "rewardSession", "parameters": sid, "requestBody": _body("RewardBody"),
                "responses": _answers("reward recorded", *session)}},
            "/v1/sessions/{session_id}/finish": {"post": {
                "operationId": "finishSession", "parameters": sid, "requestBody": _body("FinishBody", required=False),
                "responses": _answers("session finished", *session)}},
            "/healthz": {"get": {"operationId": "health", "security": [],
                                 "responses": {"200": {"description": "NATS and Redis reachable"},
                                               "503": {"description": "names what is down"}}}},
        },
    }
