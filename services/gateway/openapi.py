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


_REASONS = {400: "invalid request", 401: "missing or wrong API key", 403: "needs a user key",
            404: "unknown model, session, response, worker or scheduler", 409: "session conflict",
            413: "body too large", 429: "a limit of the key: retry after `Retry-After` seconds",
            503: "NATS, Redis or the trajectory manager unavailable", 504: "no answer in time"}


def _errors(*statuses: int) -> dict[str, Any]:
    return {str(status): {"description": _REASONS[status],
                          "content": {"application/json": {"schema": {"$ref": REF.format(name="ErrorResponse")}}}}
            for status in statuses}


def _answers(ok: str, *errors: int, stream: bool = False, status: str = "200") -> dict[str, Any]:
    out: dict[str, Any] = {status: {"description": ok, "content": {"application/json": {"schema": {"type": "object"}}}}}
    if stream:
        out[status]["content"]["text/event-stream"] = {"schema": {"type": "string"}}
    return {**out, **_errors(*errors)}


def document(cfg: GatewayConfig) -> dict[str, Any]:
    _, components = msgspec.json.schema_components(schemas.AGENT_BODIES + (ResponseCreateRequest, ErrorResponse), ref_template=REF)
    turn = (400, 401, 404, 413, 429, 503, 504)
    session = (400, 401, 404, 409, 413, 429, 503, 504)
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
                "responses": _answers("a stored response", 401, 404, 429, 503)}},
            "/v1/models": {"get": {"operationId": "listModels", "responses": _answers("the served model", 401, 429)}},
            "/v1/sessions": {"post": {
                "operationId": "createSession", "requestBody": _body("SessionCreate", required=False),
                "responses": _answers("{id, api_key, group_id}; the key is shown once", 400, 401, 403, 429, 503,
                                      504)}},
            "/v1/sessions/{session_id}": {"get": {
                "operationId": "getSession", "parameters": sid,
                "responses": _answers("the session's trajectory", 401, 404, 429, 503, 504)}},
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


def admin_document(cfg: GatewayConfig) -> dict[str, Any]:
    """The admin port's document (keys, workers, hosts, metrics, health). Every operation but
    /healthz needs the admin key; the status page (/ui) is HTML for browsers and is left out."""
    _, components = msgspec.json.schema_components((schemas.KeyCreate, ErrorResponse), ref_template=REF)
    worker = [{"name": "worker_id", "in": "path", "required": True, "schema": {"type": "string"}},
              {"name": "op", "in": "path", "required": True, "schema": {"enum": ["vacate", "resume"]}}]
    return {
        "openapi": "3.1.0",
        "info": {"title": "SeamlessFlow gateway (admin)", "version": "1",
                 "description": "Operators only: never expose this port to agents."},
        "components": {"schemas": components, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
        "paths": {
            "/admin/keys": {"post": {
                "operationId": "createUserKey", "requestBody": _body("KeyCreate", required=False),
                "responses": _answers("{api_key, key_id, kind, name, created}; the key is shown once",
                                      400, 401, 413, 503, status="201")}},
            "/admin/workers": {"get": {"operationId": "listWorkers", "responses": _answers("{workers: [...]}", 401)}},
            "/admin/workers/{worker_id}/{op}": {"post": {
                "operationId": "steerWorker", "parameters": worker,
                "responses": _answers("the worker's status", 401, 404, 504)}},
            "/admin/hosts": {"get": {"operationId": "listHosts",
                                     "responses": _answers("{policy, counts, hosts}", 401, 404, 504)}},
            "/metrics": {"get": {"operationId": "metrics", "responses": {
                "200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}},
                **_errors(401)}}},
            "/healthz": {"get": {"operationId": "health", "security": [],
                                 "responses": {"200": {"description": "NATS and Redis reachable"},
                                               "503": {"description": "names what is down"}}}},
        },
    }
