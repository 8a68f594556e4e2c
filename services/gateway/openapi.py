"""/openapi.json: an OpenAPI 3.1 document generated from the Structs that decode request bodies.

Because `schemas.py` both validates bodies and feeds this document, the published
schema cannot drift from what the server accepts. Response bodies follow the
OpenAI formats and are described in prose.
"""

from __future__ import annotations

from typing import Any

import msgspec

from services.gateway import schemas
from services.gateway.schemas import TOKEN_ID_KEY
from services.gateway.responses_schemas import ResponseCreateRequest
from services.gateway.responses_translate import LOGPROBS_INCLUDE, TEXT_PARTS
from services.gateway.translate import MAX_STOPS, most_tokens
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
        out[status]["content"]["text/event-stream"] = {"schema": {  # one server-sent event, as parsed
            "type": "object", "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}}
    return {**out, **_errors(*errors)}


def _nullable(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}], "default": None, "description": description}


_ONLY_NULL = {"type": "null"}
_VALUE = REF.format(name="JsonValue")
JSON_VALUE = {"description": "any JSON value whose integers fit in 64 bits", "anyOf": [
    {"type": ["string", "boolean", "null"]}, {"type": "number", "not": {"type": "integer"}},
    {"type": "integer", "minimum": -(2**63), "maximum": 2**64 - 1},
    {"type": "array", "items": {"$ref": _VALUE}}, {"type": "object", "additionalProperties": {"$ref": _VALUE}}]}
_NO_TOP_LOGPROBS = "only 0: the rollout workers return the sampled token's logprob alone"


def _input_item(wide: dict[str, Any]) -> dict[str, Any]:
    """InputItem by its `type`: each kind with the fields it needs."""
    props = wide["properties"]
    content = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"$ref": REF.format(name="ContentPart")}}]}
    text = {"type": "string"}
    kinds = [
        ({"type": {"enum": ["message"]}, "role": props["role"]["anyOf"][0], "content": content}, ["role", "content"]),
        ({"type": {"enum": ["function_call"]}, "call_id": text, "name": text, "arguments": text},
         ["type", "call_id", "name", "arguments"]),
        ({"type": {"enum": ["function_call_output"]}, "call_id": text, "output": content},
         ["type", "call_id", "output"]),
    ]
    return {"title": "InputItem", "description": wide.get("description", ""),
            "anyOf": [{"type": "object", "properties": p, "required": r} for p, r in kinds]}


def served_subset(components: dict[str, Any], cfg: GatewayConfig) -> dict[str, Any]:
    """Narrow the decoding Structs' schemas to what this gateway serves, so that a request valid
    against the document is one it answers: the OpenAI fields it refuses by name (a 400 naming the
    parameter) are published as the one value it takes, or as absent. The Structs stay wide so
    that the refusal is an explanation, not a generic validation error. Fuzzers generate from this
    (tests/integration/test_gateway_fuzz.py); the one rule JSON Schema cannot state, a named
    tool_choice among `tools`, is in tests/integration/fuzz_hooks.py. Each list the gateway bounds
    (messages, tools, input) has its maxItems, checked on the body as sent."""
    chat, completion, responses = (components[n]["properties"] for n in
                                   ("ChatCompletionRequest", "CompletionRequest", "ResponseCreateRequest"))
    model = {"type": "string", "enum": [cfg.model], "description": "the one model this gateway serves"}
    most = most_tokens(cfg)
    bound = _nullable({"type": "integer", "minimum": 1, "maximum": most},
                      f"at most {most}: SF_GATEWAY_MAX_TOKENS_LIMIT, and room for the prompt in the context")
    for props, name in ((chat, "max_tokens"), (chat, "max_completion_tokens"), (completion, "max_tokens"),
                        (responses, "max_output_tokens")):
        props[name] = bound
    for props in (chat, completion, responses):
        props["model"] = model
    components["JsonValue"] = JSON_VALUE
    free = _nullable({"type": "object", "additionalProperties": {"$ref": REF.format(name="JsonValue")}},
                     "any JSON object; integers within 64 bits (the bus is msgpack)")
    components["FunctionDef"]["properties"]["parameters"] = free
    components["ResponseTool"]["properties"]["parameters"] = free
    components["SessionCreate"]["properties"]["metadata"] = free
    _served_chat(components, chat, completion)
    _served_responses(components, responses)
    _bounded_lists(chat, responses, cfg)
    return components


def _bounded_lists(chat: dict[str, Any], responses: dict[str, Any], cfg: GatewayConfig) -> None:
    """maxItems where the gateway bounds a list (translate.at_most), none where the limit is off."""
    lists = [(chat["messages"], cfg.max_messages, "SF_GATEWAY_MAX_MESSAGES"),
             (responses["input"]["anyOf"][1], cfg.max_messages - 1,
              "SF_GATEWAY_MAX_MESSAGES, less one kept for `instructions`"),
             (chat["tools"]["anyOf"][0], cfg.max_tools, "SF_GATEWAY_MAX_TOOLS"),
             (responses["tools"]["anyOf"][0], cfg.max_tools, "SF_GATEWAY_MAX_TOOLS")]
    for schema, most, setting in lists:
        if most > 0:
            schema["maxItems"] = most
            schema["description"] = f"at most {most} ({setting})"


def _served_chat(components: dict[str, Any], chat: dict[str, Any], completion: dict[str, Any]) -> None:
    one = _nullable({"type": "integer", "enum": [1]}, "only 1: one sample per request")
    for props in (chat, completion):
        props["n"] = one
        bias = props["logit_bias"]["anyOf"][0]
        props["logit_bias"]["anyOf"][0] = {**bias, "propertyNames": {"pattern": TOKEN_ID_KEY}}
        props["stop"] = _nullable({"anyOf": [{"type": "string", "minLength": 1},  # OpenAI's limit, none empty
                                             {"type": "array", "maxItems": MAX_STOPS,
                                              "items": {"type": "string", "minLength": 1}}]},
                                  f"at most {MAX_STOPS} non-empty strings")
    chat["top_logprobs"] = _nullable({"type": "integer", "enum": [0]}, _NO_TOP_LOGPROBS)
    chat["tool_choice"] = _nullable({"anyOf": [{"enum": ["auto", "none"]}, {"$ref": REF.format(name="ToolChoice")}]},
                                    "'required' is not served; a named function must be one of `tools`")
    components["ResponseFormat"]["properties"]["type"] = {"enum": ["text"]}
    completion["logprobs"] = _nullable({"type": "integer", "enum": [0]}, _NO_TOP_LOGPROBS)
    completion["echo"] = _nullable({"enum": [False]}, "echo is not served")
    completion["suffix"] = _nullable({"type": "null"}, "suffix is not served")
    completion["best_of"] = one


def _served_responses(components: dict[str, Any], responses: dict[str, Any]) -> None:
    responses["top_logprobs"] = _nullable({"type": "integer", "enum": [0]}, _NO_TOP_LOGPROBS)
    responses["background"] = _nullable({"enum": [False]}, "background responses are not served")
    responses["truncation"] = _nullable({"enum": ["disabled"]}, "a conversation past the context is a 400")
    responses["include"] = _nullable({"type": "array", "items": {"enum": [LOGPROBS_INCLUDE]}},
                                     "only the sampled tokens' logprobs")
    for name in ("conversation", "prompt", "context_management", "max_tool_calls"):
        responses[name] = {**_ONLY_NULL, "description": f"{name} is not served"}
    responses["tool_choice"] = _nullable(
        {"anyOf": [{"enum": ["auto", "none"]}, {"$ref": REF.format(name="ToolChoiceObject")}]},
        "'required' is not served; a named function must be one of `tools`")
    responses["input"] = {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1,
                                                            "items": {"$ref": REF.format(name="InputItem")}}],
                          "description": "the new input; with previous_response_id, what follows that response"}
    components["ResponseCreateRequest"]["required"] = ["model", "input"]
    choice = components["ToolChoiceObject"]["properties"]
    choice.update(type={"enum": ["function"]}, name=choice["name"]["anyOf"][0])
    components["ToolChoiceObject"]["required"] = ["type", "name"]
    tool = components["ResponseTool"]
    tool["properties"].update(type={"enum": ["function"]}, name=tool["properties"]["name"]["anyOf"][0])
    tool["required"] = ["type", "name"]
    components["TextFormat"]["properties"]["type"] = {"enum": ["text"]}
    components["TextConfig"]["properties"]["verbosity"] = {**_ONLY_NULL, "description": "not served"}
    components["ReasoningConfig"]["properties"] = {
        "effort": _nullable({"enum": ["none"]}, "this model produces no reasoning"),
        "summary": {**_ONLY_NULL, "description": "not served"},
        "generate_summary": {**_ONLY_NULL, "description": "not served"}}
    components["ContentPart"]["properties"] = {"type": {"enum": list(TEXT_PARTS)}, "text": {"type": "string"}}
    components["ContentPart"]["required"] = ["type", "text"]
    components["InputItem"] = _input_item(components["InputItem"])


def document(cfg: GatewayConfig) -> dict[str, Any]:
    _, components = msgspec.json.schema_components(schemas.AGENT_BODIES + (ResponseCreateRequest, ErrorResponse), ref_template=REF)
    components = served_subset(components, cfg)
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
                "responses": _answers("{api_key, key_id, kind, name, created, limits}; the key is shown once",
                                      400, 401, 413, 503, status="201")}},
            "/admin/workers": {"get": {"operationId": "listWorkers", "responses": _answers("{workers: [...]}", 401)}},
            "/admin/workers/{worker_id}/{op}": {"post": {
                "operationId": "steerWorker", "parameters": worker,
                "responses": _answers("the worker's status", 401, 404, 503, 504)}},
            "/admin/hosts": {"get": {"operationId": "listHosts",
                                     "responses": _answers("{policy, counts, hosts}", 401, 404, 503, 504)}},
            "/metrics": {"get": {"operationId": "metrics", "responses": {
                "200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}},
                **_errors(401)}}},
            "/healthz": {"get": {"operationId": "health", "security": [],
                                 "responses": {"200": {"description": "NATS and Redis reachable"},
                                               "503": {"description": "names what is down"}}}},
        },
    }
