"""HTTP bodies -> wire messages: the rules a JSON schema cannot say, and the mapping to ChatRequest.

Pure: no I/O. The gateway checks what it cheaply can (model name, n, stop strings,
max_tokens against max_context); the trajectory manager owns everything that
needs the tokenizer (the exact context-length check) and answers ChatFailed.

What reaches the trajectory manager in `ChatRequest.messages`, one JSON object per message (the
validated message Struct where it already has this form, else a dict built to it):
    {"role": "system"|"user"|"assistant"|"tool", "content": str}
    + "name" when the client sent one
    + "tool_calls": [{"id", "type": "function", "function": {"name", "arguments": str}}] (assistant)
    + "tool_call_id" (tool)
Content is always a string: text parts are joined with "\\n", null becomes "";
the "developer" role is forwarded as "system".
`ChatRequest.tools` holds OpenAI tool objects {"type": "function", "function": {...}}.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from services.gateway.config import GatewayConfig
from services.gateway.errors import ApiError
from services.gateway.schemas import (
    MAX_TOKEN_ID,
    TOKEN_ID_KEY,
    AssistantMessage,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DeveloperMessage,
    SamplingParams,
    SystemMessage,
    ToolChoice,
    ToolMessage,
    UserMessage,
    text_of,
)
from shared.messages.chat import ChatRequest
from shared.messages.rollout import Sampling

COMPLETIONS_MAX_TOKENS_DEFAULT = 16  # OpenAI's default for /v1/completions
MAX_STOPS = 4  # OpenAI's limit on stop strings
# matched as msgspec and Python's JSON Schema validators match a pattern (re.search: ASCII digits
# only, as "²".isdigit() is True; `$` also matches before a final newline, which int() ignores)
_TOKEN_ID = re.compile(TOKEN_ID_KEY)


def check_model(model: str, served: str) -> None:
    if model != served:
        raise ApiError(404, f"The model `{model}` does not exist; this gateway serves `{served}`.",
                       "model_not_found", "model")


def most_tokens(cfg: GatewayConfig) -> int:
    """The largest max_tokens (max_completion_tokens, max_output_tokens) a turn may ask: within
    SF_GATEWAY_MAX_TOKENS_LIMIT (0: none), leaving the prompt at least one token of the context."""
    room = cfg.max_context - 1
    return min(cfg.max_tokens_limit, room) if cfg.max_tokens_limit else room


def at_most(items: list[Any] | None, most: int, param: str, code: str, setting: str) -> None:
    """A list in the body longer than `most` (0: no limit) is a 400 naming it (the schema's maxItems)."""
    if most and items is not None and len(items) > most:
        raise ApiError(400, f"{param} has {len(items)} items, more than this gateway accepts in one request "
                            f"({most}, {setting})", code, param)


def sampling(p: SamplingParams, max_tokens: int | None, default_max_tokens: int, max_context: int,
             param: str = "max_tokens") -> Sampling:
    """Validate the cross-field rules and build the wire Sampling (None -> its default).
    `param`: the body's name for `max_tokens`."""
    if p.n not in (None, 1):
        raise ApiError(400, f"n={p.n} is not supported: only n=1; send one request per sample "
                            "(or one session per sample with a shared group_id)", "unsupported_value", "n")
    tokens = default_max_tokens if max_tokens is None else max_tokens
    if tokens >= max_context:
        raise ApiError(400, f"{param}={tokens} leaves no room for the prompt: this model's context "
                            f"length is {max_context} tokens", "context_length_exceeded", param)
    bias: dict[int, float] = {}
    for token, value in (p.logit_bias or {}).items():
        if not _TOKEN_ID.search(token):
            raise ApiError(400, f"logit_bias keys must be token ids (0 to {MAX_TOKEN_ID}), got {token!r}",
                           "invalid_value", "logit_bias")
        bias[int(token)] = value
    fields: dict[str, Any] = {
        "max_tokens": tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": None if p.top_k is None else max(p.top_k, 0),  # -1 (vLLM) and 0 both disable it
        "min_p": p.min_p,
        "seed": p.seed,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "stop_token_ids": p.stop_token_ids,
        "logit_bias": bias or None,
    }
    return Sampling(**{k: v for k, v in fields.items() if v is not None})


def stop_strings(p: SamplingParams) -> list[str]:
    """`stop`: a string or up to MAX_STOPS strings, none empty."""
    stops = [p.stop] if isinstance(p.stop, str) else list(p.stop or [])
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", "invalid_value", "stop")
    if any(not s for s in stops):
        raise ApiError(400, "stop strings must not be empty", "invalid_value", "stop")
    return stops


# each message type's role is its tag; a developer message reaches the template as a system one
_ROLES: dict[type, str] = {tp: tp.__struct_config__.tag for tp in (SystemMessage, UserMessage, AssistantMessage,
                                                                    ToolMessage)} | {DeveloperMessage: "system"}


# the message types that are already in wire form when their content is a string (schemas.py declares
# their fields in the wire's order and omits what is unset): sent as they are, encoded in C
_AS_IS = frozenset((SystemMessage, UserMessage, ToolMessage))


def _message(m: ChatMessage) -> dict[str, Any] | ChatMessage:
    # Runs for every message of every request (a 200-turn session resends 400). A message already in
    # wire form is sent as the Struct it was decoded into (it encodes as the dict below would: the same
    # keys in the same order, which the trajectory manager's raw digests of the messages hash); the
    # rest become that dict: one lookup for the role, no attribute a message type lacks.
    tp = type(m)
    content = m.content
    if type(content) is str and (
            tp in _AS_IS and (tp is ToolMessage or m.name is None)
            or tp is AssistantMessage and m.name is None and m.refusal is None and m.tool_calls != []):
        return m
    out: dict[str, Any] = {"role": _ROLES[tp], "content": content if type(content) is str else text_of(content)}
    if tp is ToolMessage:
        out["tool_call_id"] = m.tool_call_id
        return out
    if m.name:
        out["name"] = m.name
    if tp is AssistantMessage and m.tool_calls:
        out["tool_calls"] = [msgspec.to_builtins(c) for c in m.tool_calls]
    return out


def _no_nulls(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def apply_tool_choice(tools: list[dict[str, Any]], choice: str, name: str | None, code: str) -> list[dict[str, Any]]:
    """The tools the model sees under `tool_choice` (chat and Responses alike): "auto" all of them,
    "none" none, "function" only the named one (a nudge, not a grammar constraint); "required" is
    not served. `code`: the error code each API uses for an unsupported value."""
    if choice == "auto":
        return tools
    if choice == "required":
        raise ApiError(400, "tool_choice 'required' is not supported; use 'auto', 'none' or a named function",
                       code, "tool_choice")
    named = [] if choice == "none" else [t for t in tools if t["function"]["name"] == name]  # "none": none seen
    if choice != "none" and not named:
        raise ApiError(400, f"tool_choice names function {name!r}, which is not in tools", "invalid_value",
                       "tool_choice")
    if len(named) < len(tools):
        fit_the_wire(tools, "tools")
    return named


def fit_the_wire(value: Any, param: str) -> None:
    """What the body holds but the wire leaves out (the tools tool_choice drops) is still the body:
    held to the wire's rule (service.wire), integers within 64 bits, as the schema says (JsonValue)."""
    try:
        msgspec.msgpack.encode(value)
    except OverflowError:
        raise ApiError(400, f"{param} holds an integer outside the 64-bit range; send it as a string",
                       "invalid_value", param) from None


def _tools(req: ChatCompletionRequest, cfg: GatewayConfig) -> list[dict[str, Any]]:
    at_most(req.tools, cfg.max_tools, "tools", "too_many_tools", "SF_GATEWAY_MAX_TOOLS")  # before tool_choice
    tools = [{"type": "function", "function": _no_nulls(msgspec.to_builtins(t.function))} for t in req.tools or []]
    choice = req.tool_choice
    if isinstance(choice, ToolChoice):
        return apply_tool_choice(tools, "function", choice.function.name, "unsupported_value")
    return apply_tool_choice(tools, choice or "auto", None, "unsupported_value")


def chat_request(req: ChatCompletionRequest, request_id: str, session_id: str, cfg: GatewayConfig) -> ChatRequest:
    check_model(req.model, cfg.model)
    if req.top_logprobs:
        raise ApiError(400, "top_logprobs > 0 is not supported: the rollout workers return the sampled "
                            "token's logprob only (logprobs=true gives those)", "unsupported_value", "top_logprobs")
    if req.response_format is not None and req.response_format.type != "text":
        raise ApiError(400, f"response_format {req.response_format.type!r} is not supported; only 'text'",
                       "unsupported_value", "response_format")
    at_most(req.messages, cfg.max_messages, "messages", "too_many_messages", "SF_GATEWAY_MAX_MESSAGES")
    max_tokens, param = _max_tokens(req, cfg)
    return ChatRequest(
        request_id=request_id,
        session_id=session_id,
        kind="chat",
        model=req.model,
        sampling=sampling(req, max_tokens, cfg.max_tokens_default, cfg.max_context, param),
        messages=[_message(m) for m in req.messages],
        tools=_tools(req, cfg),
        stop=stop_strings(req),
        logprobs=bool(req.logprobs),
        agent_streams=bool(req.stream),  # deltas always flow (liveness); this says whether the agent sees them
    )


def _max_tokens(req: ChatCompletionRequest, cfg: GatewayConfig) -> tuple[int | None, str]:
    """max_completion_tokens, else max_tokens (OpenAI's precedence), with the body's name for it.
    A max_tokens sent beside max_completion_tokens is unused, yet held to the same bound, as the
    schema says of it."""
    if req.max_completion_tokens is None:
        return req.max_tokens, "max_tokens"
    if req.max_tokens is not None and req.max_tokens > (most := most_tokens(cfg)):
        raise ApiError(400, f"max_tokens={req.max_tokens} is more than this gateway allows ({most}), even beside "
                            "max_completion_tokens", "max_tokens_too_large", "max_tokens")
    return req.max_completion_tokens, "max_completion_tokens"


def completion_request(req: CompletionRequest, request_id: str, session_id: str, cfg: GatewayConfig) -> ChatRequest:
    check_model(req.model, cfg.model)
    if req.echo:
        raise ApiError(400, "echo is not supported", "unsupported_value", "echo")
    if req.suffix:
        raise ApiError(400, "suffix is not supported", "unsupported_value", "suffix")
    if req.best_of not in (None, 1):
        raise ApiError(400, "best_of must be 1", "unsupported_value", "best_of")
    if req.logprobs:
        raise ApiError(400, "logprobs > 0 is not supported: the rollout workers return the sampled token's "
                            "logprob only (logprobs=0 gives those)", "unsupported_value", "logprobs")
    return ChatRequest(
        request_id=request_id,
        session_id=session_id,
        kind="completion",
        model=req.model,
        sampling=sampling(req, req.max_tokens, COMPLETIONS_MAX_TOKENS_DEFAULT, cfg.max_context),
        prompt=req.prompt,
        stop=stop_strings(req),
        logprobs=req.logprobs is not None,
        agent_streams=bool(req.stream),
    )


def wants_usage(p: SamplingParams) -> bool:
    return bool(p.stream_options and p.stream_options.include_usage)
