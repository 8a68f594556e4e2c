"""The body of POST /v1/responses (the OpenAI Responses API), as msgspec Structs.

As in schemas.py, these Structs decode every body and feed /openapi.json. Input items
and content parts keep `type` as a plain string so that an item the gateway does not
serve (a reasoning item, an image, a built-in tool) reaches responses_translate.py,
which answers a 400 that names it, instead of a generic "invalid value". Parameters the
gateway cannot honour (`background`, built-in tools, `conversation`...) are declared here
for the same reason: a declared field is checked, an unknown one is ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from services.gateway.schemas import FunctionName, PositiveInt, Temperature, TopP


class ContentPart(msgspec.Struct, kw_only=True):
    """input_text / output_text (served); input_image, input_file, refusal... (400)."""

    type: str
    text: str | None = None


Content = str | list[ContentPart]


class InputItem(msgspec.Struct, kw_only=True):
    """One input item. `type` defaults to "message" (OpenAI's EasyInputMessage has none).

    message:              role, content
    function_call:        call_id, name, arguments (a model's call, replayed)
    function_call_output: call_id, output (the tool's result)
    """

    type: str = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: Content | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: Content | None = None
    id: str | None = None
    status: str | None = None


class ResponseTool(msgspec.Struct, kw_only=True):
    """A function tool: {"type": "function", "name", "description", "parameters", "strict"}.
    Built-in tools (web_search, file_search, computer_use_preview, ...) decode, then get a 400."""

    type: str
    name: FunctionName | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceObject(msgspec.Struct, kw_only=True):
    """{"type": "function", "name": ...} is served; other types (allowed_tools, built-ins) are a 400."""

    type: str
    name: FunctionName | None = None  # a name no tool can have is refused here; one not in `tools`, later


class TextFormat(msgspec.Struct, kw_only=True):
    type: str


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(msgspec.Struct, kw_only=True):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesStreamOptions(msgspec.Struct, kw_only=True):
    include_obfuscation: bool | None = None  # the gateway never pads deltas: nothing to turn off


class ResponseCreateRequest(msgspec.Struct, kw_only=True):
    model: str
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    tools: list[ResponseTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | ToolChoiceObject | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    store: bool | None = None  # null means true, as with OpenAI
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    include: list[str] | None = None
    text: TextConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    # declared so that they are refused by name (responses_translate.unsupported), never ignored
    background: bool | None = None
    reasoning: ReasoningConfig | None = None
    max_tool_calls: PositiveInt | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    context_management: list[dict[str, Any]] | None = None
