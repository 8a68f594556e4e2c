"""The request bodies the gateway accepts, as msgspec Structs.

These Structs are the single source of truth for input shape: the gateway
decodes every body with them, and /openapi.json is generated from them
(`openapi.py`), so the published schema is exactly what the server accepts.
Unknown fields are ignored (SDKs send extras); a known field with a wrong type
or an out-of-range value is a 400 naming that field. Rules that a schema cannot
say (n must be 1, stop strings unsupported...) live in `translate.py`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from services.gateway.errors import from_validation

T = TypeVar("T")

Temperature = Annotated[float, Meta(ge=0.0, le=2.0, description="0 is greedy")]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
PositiveInt = Annotated[int, Meta(ge=1)]
MAX_TOKEN_ID = 2**31 - 1
TokenId = Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]  # OpenAI's range; the wire (msgpack) has 64 bits
Bias = Annotated[float, Meta(ge=-100.0, le=100.0)]
FunctionName = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]


def _at_most(n: int) -> str:
    """A regular expression (JSON Schema's dialect and Python's) for the decimal numbers 0..n,
    leading zeros allowed: the shorter numbers, then n's digits with one lower at each place, then n."""
    digits = str(n)
    alts = [f"[0-9]{{1,{len(digits) - 1}}}"] if len(digits) > 1 else []
    for i, d in enumerate(digits):
        rest = len(digits) - i - 1
        if d != "0":
            lower = "0" if d == "1" else f"[0-{int(d) - 1}]"
            alts.append(digits[:i] + lower + ("" if not rest else "[0-9]" if rest == 1 else f"[0-9]{{{rest}}}"))
    return f"^0*(?:{'|'.join([*alts, digits])})$"


# a logit_bias key: a token id as a string; translate.py checks it, /openapi.json publishes it
TOKEN_ID_KEY = _at_most(MAX_TOKEN_ID)


# --- messages ----------------------------------------------------------------------------------

class TextPart(msgspec.Struct, kw_only=True):
    # A required field, not a msgspec tag: a lone tagged Struct decodes without its tag, while the
    # schema (and OpenAI) require "type" (schemathesis found the gap: ST201)
    type: Literal["text"]
    text: str


Content = str | list[TextPart]


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(msgspec.Struct, omit_defaults=True, tag_field="role", tag="system", kw_only=True):
    content: Content
    name: str | None = None


class DeveloperMessage(msgspec.Struct, omit_defaults=True, tag_field="role", tag="developer", kw_only=True):
    """Newer SDKs send "developer" where older ones send "system"; forwarded as system."""

    content: Content
    name: str | None = None


class UserMessage(msgspec.Struct, omit_defaults=True, tag_field="role", tag="user", kw_only=True):
    content: Content
    name: str | None = None


class AssistantMessage(msgspec.Struct, omit_defaults=True, tag_field="role", tag="assistant", kw_only=True):
    content: Content | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    refusal: str | None = None


class ToolMessage(msgspec.Struct, omit_defaults=True, tag_field="role", tag="tool", kw_only=True):
    content: Content
    tool_call_id: str


ChatMessage = SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage


# --- tools -------------------------------------------------------------------------------------

class FunctionDef(msgspec.Struct, kw_only=True):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDef


class ToolChoiceFunction(msgspec.Struct):
    name: FunctionName  # a name no tool can have is refused here; one not in `tools`, by translate.py


class ToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str


# --- request bodies ----------------------------------------------------------------------------

class SamplingParams(msgspec.Struct, kw_only=True):
    """Fields shared by /v1/chat/completions and /v1/completions. null means "the default"."""

    model: str
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Meta(ge=-1, le=2**31 - 1, description="-1 or 0 disables it")] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    n: PositiveInt | None = None
    seed: Seed | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Bias] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    user: str | None = None


class ChatCompletionRequest(SamplingParams, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    metadata: dict[str, str] | None = None


class CompletionRequest(SamplingParams, kw_only=True):
    prompt: Annotated[str, Meta(min_length=1, description="one string; an empty prompt leaves the model nothing "
                                                           "to continue")]
    echo: bool | None = None
    suffix: str | None = None
    best_of: PositiveInt | None = None
    logprobs: Annotated[int, Meta(ge=0, le=5)] | None = None


class SessionCreate(msgspec.Struct, kw_only=True):
    group_id: str | None = None  # sessions sharing a group_id form one GRPO group
    metadata: dict[str, Any] | None = None


class RewardBody(msgspec.Struct, kw_only=True):
    reward: float


class FinishBody(msgspec.Struct, kw_only=True):
    reward: float | None = None


class KeyCreate(msgspec.Struct, kw_only=True):
    name: str | None = None  # a label for operators; stored with the key's hash
    # the tenant's own limits (limits.TenantLimits); absent or null: the gateway's SF_GATEWAY_* setting
    rate_limit: Annotated[float, Meta(ge=0, description="requests per second; 0: off")] | None = None
    rate_burst: Annotated[int, Meta(ge=0, description="requests at once after a quiet spell")] | None = None
    max_concurrent: Annotated[int, Meta(ge=0, description="turns in flight; 0: off")] | None = None


AGENT_BODIES: tuple[type, ...] = (ChatCompletionRequest, CompletionRequest, SessionCreate, RewardBody, FinishBody)


def decode(body: bytes, tp: type[T]) -> T:
    """Decode a JSON body as `tp`, or raise ApiError(400). An empty body counts as {}.

    JSON Schema counts an integer-valued number (`0.0`, `1e2`) as an integer, and /openapi.json
    says "integer": such a value is accepted where an int is expected (msgspec alone refuses
    it). Only the slow path pays for that: the body is decoded again only after a refusal."""
    try:
        return msgspec.json.decode(body or b"{}", type=tp)
    except msgspec.ValidationError as e:
        if not _INT_GOT_FLOAT.match(str(e)):
            raise from_validation(e) from None
        return _with_whole_floats(body, tp, e)
    except msgspec.DecodeError as e:
        raise from_validation(e) from None


_INT_GOT_FLOAT = re.compile(r"^Expected `int[^`]*`, got `float` - at `\$(.*)`$")
_STEP = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]")
MAX_WHOLE_FLOATS = 64  # integer-valued floats converted in one body; past that, the refusal stands


def _with_whole_floats(body: bytes, tp: type[T], error: msgspec.ValidationError) -> T:
    """`body` as `tp`, each integer-valued float msgspec refused as an int made an int; or the
    ApiError of the first refusal that is not one of those."""
    raw: Any = msgspec.json.decode(body)
    for _ in range(MAX_WHOLE_FLOATS):
        m = _INT_GOT_FLOAT.match(str(error))
        if m is None or not _make_int(raw, m.group(1)):
            break
        try:
            return msgspec.convert(raw, tp)
        except msgspec.ValidationError as e:
            error = e
    raise from_validation(error) from None


def _make_int(raw: Any, path: str) -> bool:
    """Replace the integer-valued float at `path` (msgspec's "$.a[0].b" without the "$") in place."""
    steps: list[str | int] = [name or int(index) for name, index in _STEP.findall(path)]
    if not steps or "".join(f".{s}" if isinstance(s, str) else f"[{s}]" for s in steps) != path:
        return False  # a path this walk does not understand (e.g. through a dict key)
    parent = raw
    try:
        for step in steps[:-1]:
            parent = parent[step]
        value = parent[steps[-1]]
    except (KeyError, IndexError, TypeError):
        return False
    if not (isinstance(value, float) and value.is_integer()):
        return False
    parent[steps[-1]] = int(value)
    return True


def text_of(content: Content | None) -> str:
    """Text parts are joined with newlines, as vLLM's OpenAI server does."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part.text for part in content)
