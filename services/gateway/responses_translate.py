"""/v1/responses bodies -> the ChatRequest of a chat turn (pure: no I/O).

A Responses turn *is* a chat turn. `instructions` becomes the first system message, the
input items become chat messages, function tools become chat tools, in exactly the shapes
translate.py gives chat bodies. The trajectory manager then finds, renders and records it
as it does a chat turn, so both APIs share one prefix tree and one session may mix them
(the conversation keys agree; tests/unit/test_gateway_responses.py checks it).

Input items -> messages:
    message (user, system, developer, assistant)  {"role", "content": str}; developer -> system;
                                                  text parts joined with "\\n", as for chat
    function_call                                 a tool call of the assistant message just before
                                                  it (the model's text and calls are one message),
                                                  or of a new assistant message with content ""
    function_call_output                          {"role": "tool", "content", "tool_call_id": call_id}

`previous_response_id`: the stored conversation of that response (its inputs and its reply,
instructions excluded: as with OpenAI, they are not carried over) comes before the new input.
What the gateway cannot serve is a 400 naming the parameter (`unsupported`), never ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.gateway.config import GatewayConfig
from services.gateway.errors import ApiError
from services.gateway.responses_schemas import Content, InputItem, ResponseCreateRequest
from services.gateway.translate import apply_tool_choice, at_most, check_model
from shared.messages.chat import ChatDone, ChatRequest
from shared.messages.rollout import Sampling

LOGPROBS_INCLUDE = "message.output_text.logprobs"
TEXT_PARTS = ("input_text", "output_text")


@dataclass(frozen=True)
class Translated:
    chat: ChatRequest
    conversation: list[dict[str, Any]]  # the messages after `instructions`; the reply is appended when done


def _unsupported(message: str, param: str) -> ApiError:
    return ApiError(400, message, "unsupported_parameter", param)


def unsupported(req: ResponseCreateRequest) -> None:
    """Refuse, by name, what the gateway does not serve."""
    if req.background:
        raise _unsupported("background responses are not supported: send the request and wait (or stream)",
                           "background")
    if req.conversation is not None:
        raise _unsupported("conversation objects are not supported; use previous_response_id or send the "
                           "whole history in input", "conversation")
    if req.prompt is not None:
        raise _unsupported("stored prompt templates are not supported; send instructions and input", "prompt")
    if req.context_management:
        raise _unsupported("context_management is not supported", "context_management")
    if req.max_tool_calls is not None:
        raise _unsupported("max_tool_calls is not supported (it limits built-in tools, which are not served)",
                           "max_tool_calls")
    if req.reasoning is not None and (req.reasoning.effort not in (None, "none") or req.reasoning.summary
                                      or req.reasoning.generate_summary):
        raise _unsupported("reasoning is not supported: this model produces no reasoning items", "reasoning")
    if req.truncation == "auto":
        raise _unsupported("truncation 'auto' is not supported: a conversation longer than the context window "
                           "is a 400 (truncation 'disabled')", "truncation")
    if req.top_logprobs:
        raise _unsupported("top_logprobs > 0 is not supported: the rollout workers return the sampled token's "
                           f"logprob only (include {LOGPROBS_INCLUDE!r} gives those)", "top_logprobs")
    for i, value in enumerate(req.include or []):
        if value != LOGPROBS_INCLUDE:
            raise _unsupported(f"include {value!r} is not supported; only {LOGPROBS_INCLUDE!r}", f"include[{i}]")
    text = req.text
    if text is not None and text.format is not None and text.format.type != "text":
        raise _unsupported(f"text.format {text.format.type!r} is not supported; only 'text'", "text.format")
    if text is not None and text.verbosity is not None:
        raise _unsupported("text.verbosity is not supported", "text.verbosity")


def _text(content: Content | None, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    for j, part in enumerate(content):
        if part.type not in TEXT_PARTS:
            raise _unsupported(f"content parts of type {part.type!r} are not supported; only text "
                               f"({', '.join(TEXT_PARTS)})", f"{param}[{j}].type")
        if part.text is None:
            raise ApiError(400, f"a {part.type} part needs `text`", "missing_required_parameter", f"{param}[{j}].text")
    return "\n".join(part.text or "" for part in content)


def _required(item: InputItem, i: int, *fields: str) -> None:
    for field in fields:
        if getattr(item, field) is None:
            raise ApiError(400, f"input[{i}] of type {item.type!r} needs `{field}`", "missing_required_parameter",
                           f"input[{i}].{field}")


def _function_call(item: InputItem, i: int, messages: list[dict[str, Any]]) -> None:
    _required(item, i, "call_id", "name", "arguments")
    call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def messages_of(items: str | list[InputItem]) -> list[dict[str, Any]]:
    """The chat messages of `input` (a string is one user message)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        match item.type:
            case "message":
                _required(item, i, "role", "content")
                role = "system" if item.role == "developer" else item.role
                messages.append({"role": role, "content": _text(item.content, f"input[{i}].content")})
            case "function_call":
                _function_call(item, i, messages)
            case "function_call_output":
                _required(item, i, "call_id", "output")
                messages.append({"role": "tool", "content": _text(item.output, f"input[{i}].output"),
                                 "tool_call_id": item.call_id})
            case "reasoning":
                raise _unsupported("reasoning items are not supported: this model produces none", f"input[{i}].type")
            case other:
                raise _unsupported(f"input items of type {other!r} are not supported; only message, function_call "
                                   "and function_call_output", f"input[{i}].type")
    return messages


def tools(req: ResponseCreateRequest, max_tools: int = 0) -> list[dict[str, Any]]:
    """Chat tools ({"type": "function", "function": {...}}, keys in chat's order), after tool_choice.
    `max_tools` (0: no limit) counts the body's tools, before tool_choice leaves some out."""
    at_most(req.tools, max_tools, "tools", "too_many_tools", "SF_GATEWAY_MAX_TOOLS")
    out: list[dict[str, Any]] = []
    for i, t in enumerate(req.tools or []):
        if t.type != "function":
            raise _unsupported(f"built-in tool {t.type!r} is not supported; only function tools", f"tools[{i}].type")
        if t.name is None:
            raise ApiError(400, "a function tool needs `name`", "missing_required_parameter", f"tools[{i}].name")
        fields = {"name": t.name, "description": t.description, "parameters": t.parameters, "strict": t.strict}
        out.append({"type": "function", "function": {k: v for k, v in fields.items() if v is not None}})
    choice = req.tool_choice
    if choice is None or isinstance(choice, str):
        return apply_tool_choice(out, choice or "auto", None, "unsupported_parameter")
    if choice.type != "function":
        raise _unsupported(f"tool_choice of type {choice.type!r} is not supported; use 'auto', 'none' or "
                           "{'type': 'function', 'name': ...}", "tool_choice")
    return apply_tool_choice(out, "function", choice.name, "unsupported_parameter")


def sampling(req: ResponseCreateRequest, cfg: GatewayConfig) -> Sampling:
    tokens = cfg.max_tokens_default if req.max_output_tokens is None else req.max_output_tokens
    if tokens >= cfg.max_context:
        raise ApiError(400, f"max_output_tokens={tokens} leaves no room for the input: this model's context "
                            f"length is {cfg.max_context} tokens", "context_length_exceeded", "max_output_tokens")
    fields = {"max_tokens": tokens, "temperature": req.temperature, "top_p": req.top_p}
    return Sampling(**{k: v for k, v in fields.items() if v is not None})


def chat_request(req: ResponseCreateRequest, request_id: str, session_id: str, cfg: GatewayConfig,
                 history: list[dict[str, Any]]) -> Translated:
    """`history`: the stored conversation of previous_response_id ([] without one)."""
    check_model(req.model, cfg.model)
    unsupported(req)
    if req.input is None and not history:
        raise ApiError(400, "input is required (or previous_response_id and input)", "missing_required_parameter",
                       "input")
    # one message is kept for `instructions`, so that the input alone decides (the schema's maxItems)
    at_most(req.input if isinstance(req.input, list) else None, max(cfg.max_messages - 1, 0), "input",
            "too_many_messages", "SF_GATEWAY_MAX_MESSAGES")
    new = messages_of(req.input if req.input is not None else [])
    if not new:
        raise ApiError(400, "input must not be empty", "invalid_value", "input")
    conversation = history + new
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    chat = ChatRequest(
        request_id=request_id,
        session_id=session_id,
        kind="chat",
        model=req.model,
        sampling=sampling(req, cfg),
        messages=system + conversation,
        tools=tools(req, cfg.max_tools),
        logprobs=LOGPROBS_INCLUDE in (req.include or []),
        agent_streams=bool(req.stream),
    )
    return Translated(chat, conversation)


def reply_message(done: ChatDone) -> dict[str, Any]:
    """The reply as the next turn's chat message: the shape the trajectory manager records (and keys)."""
    reply: dict[str, Any] = {"role": "assistant", "content": done.text}
    if done.tool_calls:
        reply["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                               for c in done.tool_calls]
    return reply
