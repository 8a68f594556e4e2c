"""Request validation and translation (services/gateway/schemas.py, translate.py, errors.py, config.py).

Pure: no sockets. Each rule is checked for the status, `param` and message an agent sees.
"""

from __future__ import annotations

import msgspec
import pytest

from services.gateway import translate
from services.gateway.config import GatewayConfig
from services.gateway.errors import ApiError, from_exception
from services.gateway.openapi import document
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest, RewardBody, SessionCreate, decode
from shared.bus import BusUnavailable, NoResponders, ReplyTimeout
from shared.config import ConfigError, load
from shared.messages.rollout import Sampling

CFG = GatewayConfig(model="m", max_context=1024, max_tokens_default=100)
USER = {"role": "user", "content": "hi"}


def chat(**fields) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [USER], **fields}
    return decode(msgspec.json.encode(body), ChatCompletionRequest)


def rejected(fn, *args, **kwargs) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args, **kwargs)
    return info.value


# --- decoding: shape and ranges come from the Structs ----------------------------------------------

@pytest.mark.parametrize("field,value,param,code", [
    ("temperature", "hot", "temperature", "invalid_type"),
    ("temperature", 2.5, "temperature", "invalid_value"),
    ("temperature", -0.1, "temperature", "invalid_value"),
    ("top_p", 0, "top_p", "invalid_value"),
    ("top_p", 1.5, "top_p", "invalid_value"),
    ("presence_penalty", 3, "presence_penalty", "invalid_value"),
    ("frequency_penalty", -2.5, "frequency_penalty", "invalid_value"),
    ("max_tokens", 0, "max_tokens", "invalid_value"),
    ("max_tokens", "10", "max_tokens", "invalid_type"),
    ("stream", "yes", "stream", "invalid_type"),
    ("top_k", -2, "top_k", "invalid_value"),
    ("min_p", 1.5, "min_p", "invalid_value"),
    ("seed", 1.5, "seed", "invalid_type"),
    ("logit_bias", {"5": 101}, "logit_bias[...]", "invalid_value"),
    ("stop_token_ids", [-1], "stop_token_ids[0]", "invalid_value"),
    ("tool_choice", "sometimes", "tool_choice", "invalid_value"),
    ("messages", [], "messages", "invalid_value"),
    ("messages", [{"role": "robot", "content": "x"}], "messages[0].role", "invalid_value"),
    ("messages", [{"role": "user", "content": None}], "messages[0].content", "invalid_type"),
    ("messages", [{"role": "user", "content": 5}], "messages[0].content", "invalid_type"),
    ("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     "messages[0].content[0].type", "invalid_value"),
    ("messages", [{"role": "tool", "content": "x"}], "messages[0].tool_call_id", "missing_required_parameter"),
    ("tools", [{"type": "function", "function": {"name": "bad name!"}}], "tools[0].function.name", "invalid_value"),
])
def test_bad_fields_are_400_naming_the_field(field, value, param, code):
    e = rejected(chat, **{field: value})
    assert (e.status, e.type, e.param, e.code) == (400, "invalid_request_error", param, code)
    assert param.split(".")[0].split("[")[0] in e.message


def test_missing_model_and_malformed_json():
    e = rejected(decode, b'{"messages": [{"role": "user", "content": "x"}]}', ChatCompletionRequest)
    assert (e.status, e.param, e.code) == (400, "model", "missing_required_parameter")
    e = rejected(decode, b'{"model": "m", "messages": [', ChatCompletionRequest)
    assert (e.status, e.code) == (400, "invalid_json") and "not valid JSON" in e.message
    e = rejected(decode, b"[1, 2]", ChatCompletionRequest)
    assert e.status == 400


def test_unknown_fields_and_nulls_are_accepted():
    req = chat(store=True, reasoning_effort="low", temperature=None, tools=None, n=None,
               messages=[{"role": "user", "content": "x", "extra": 1}])
    assert req.temperature is None and req.n is None


def test_empty_body_decodes_as_empty_object_for_optional_bodies():
    assert decode(b"", SessionCreate).group_id is None
    e = rejected(decode, b"", RewardBody)
    assert e.param == "reward"


# --- translation: cross-field rules and the ChatRequest the trajectory manager sees -------------------

def test_chat_request_fields():
    req = chat(
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "u"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
        ],
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        temperature=0.5, top_p=0.9, top_k=-1, min_p=0.1, seed=3, presence_penalty=0.5,
        frequency_penalty=-0.5, logit_bias={"7": -100}, stop_token_ids=[2], max_tokens=50,
        stream=True, user="agent-1", metadata={"k": "v"}, parallel_tool_calls=False,
    )
    out = translate.chat_request(req, "rid", "sess", CFG)
    assert (out.request_id, out.session_id, out.kind, out.model, out.agent_streams) == ("rid", "sess", "chat", "m", True)
    assert on_the_wire(out.messages) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb", "name": "u"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    assert out.tools == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert out.sampling == Sampling(max_tokens=50, temperature=0.5, top_p=0.9, top_k=0, min_p=0.1, seed=3,
                                    presence_penalty=0.5, frequency_penalty=-0.5, stop_token_ids=[2],
                                    logit_bias={7: -100.0})


def test_forwarded_messages_keep_their_bytes_key_order_included():
    # the trajectory manager finds a session's last turn by a raw digest of the resent messages' exact
    # bytes (conversation.raw_digest): a gateway that ordered the keys differently would miss it
    req = chat(messages=[
        {"role": "system", "content": "s", "name": "sys"},
        {"role": "user", "content": "u", "name": "n"},
        {"role": "assistant", "content": "a", "name": "x", "refusal": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "r"}]},
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "user", "content": "", "name": ""},
    ])
    out = on_the_wire(translate.chat_request(req, "rid", "sess", CFG).messages)
    assert [list(m) for m in out] == [["role", "content", "name"], ["role", "content", "name"],
                                      ["role", "content", "name", "tool_calls"], ["role", "content", "tool_call_id"],
                                      ["role", "content"], ["role", "content"]]
    assert msgspec.msgpack.encode(out[2]) == msgspec.msgpack.encode(
        {"role": "assistant", "content": "a", "name": "x",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]})


def on_the_wire(messages: list) -> list[dict]:
    """The messages as the trajectory manager decodes them (some are sent as the validated Structs)."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(messages))


def test_messages_sent_as_structs_encode_byte_for_byte_as_their_dicts():
    # the gateway sends a message already in wire form as the Struct it was decoded into (no dict built
    # per message of a 400-message request): its bytes must be the dict's, or a session's raw digests
    # would change with the gateway's version. The dicts here are built by hand, as the wire says.
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}
    cases = [
        ({"role": "system", "content": "s"}, {"role": "system", "content": "s"}),
        ({"role": "system", "content": "s", "name": "n"}, {"role": "system", "content": "s", "name": "n"}),
        ({"role": "developer", "content": "d"}, {"role": "system", "content": "d"}),
        ({"role": "user", "content": "u"}, {"role": "user", "content": "u"}),
        ({"role": "user", "name": "", "content": "u"}, {"role": "user", "content": "u"}),
        ({"role": "user", "content": [{"type": "text", "text": "a"}]}, {"role": "user", "content": "a"}),
        ({"role": "assistant", "content": "a"}, {"role": "assistant", "content": "a"}),
        ({"role": "assistant", "content": "a", "refusal": None}, {"role": "assistant", "content": "a"}),
        ({"role": "assistant", "content": "a", "refusal": "no"}, {"role": "assistant", "content": "a"}),
        ({"role": "assistant", "content": None}, {"role": "assistant", "content": ""}),
        ({"role": "assistant", "tool_calls": [call], "content": ""},
         {"role": "assistant", "content": "", "tool_calls": [call]}),
        ({"role": "assistant", "content": "", "tool_calls": []}, {"role": "assistant", "content": ""}),
        ({"role": "tool", "tool_call_id": "c1", "content": "r"}, {"role": "tool", "content": "r", "tool_call_id": "c1"}),
    ]
    out = translate.chat_request(chat(messages=[sent for sent, _ in cases]), "r", "", CFG).messages
    as_is = [m for m in out if isinstance(m, msgspec.Struct)]
    assert len(as_is) >= 6  # the fast path is taken where it can be
    for (sent, wire), m in zip(cases, out, strict=True):
        assert msgspec.msgpack.encode(m) == msgspec.msgpack.encode(wire), sent


def test_defaults_and_max_tokens_precedence():
    assert translate.chat_request(chat(), "r", "", CFG).sampling == Sampling(max_tokens=100)
    both = chat(max_tokens=10, max_completion_tokens=20)
    assert translate.chat_request(both, "r", "", CFG).sampling.max_tokens == 20
    comp = decode(b'{"model": "m", "prompt": "once"}', CompletionRequest)
    out = translate.completion_request(comp, "r", "", CFG)
    assert (out.kind, out.prompt, out.messages, out.sampling.max_tokens) == ("completion", "once", [], 16)


def test_tool_choice():
    tools = [{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "b"}}]
    names = lambda req: [t["function"]["name"] for t in translate.chat_request(req, "r", "", CFG).tools]  # noqa: E731
    assert names(chat(tools=tools, tool_choice="auto")) == ["a", "b"]
    assert names(chat(tools=tools, tool_choice="none")) == []
    assert names(chat(tools=tools, tool_choice={"type": "function", "function": {"name": "b"}})) == ["b"]
    e = rejected(translate.chat_request, chat(tools=tools, tool_choice={"type": "function", "function": {"name": "z"}}),
                 "r", "", CFG)
    assert (e.status, e.param) == (400, "tool_choice")
    e = rejected(translate.chat_request, chat(tools=tools, tool_choice="required"), "r", "", CFG)
    assert e.status == 400 and "required" in e.message


@pytest.mark.parametrize("fields,param,needle", [
    ({"n": 2}, "n", "only n=1"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4 strings"),
    ({"stop": ["END", ""]}, "stop", "must not be empty"),
    ({"stop": ""}, "stop", "must not be empty"),
    ({"top_logprobs": 2}, "top_logprobs", "top_logprobs > 0 is not supported"),
    ({"max_tokens": 1024}, "max_tokens", "context length is 1024"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "token ids"),
    ({"response_format": {"type": "json_object"}}, "response_format", "not supported"),
])
def test_unsupported_values_are_400(fields, param, needle):
    e = rejected(translate.chat_request, chat(**fields), "r", "", CFG)
    assert (e.status, e.param) == (400, param) and needle in e.message


def test_empty_stop_and_false_logprobs_are_fine():
    out = translate.chat_request(chat(stop=[], logprobs=False, top_logprobs=0, n=1), "r", "", CFG)
    assert (out.stop, out.logprobs, out.sampling) == ([], False, Sampling(max_tokens=100))


def test_stop_strings_become_a_list():
    assert translate.chat_request(chat(stop="END"), "r", "", CFG).stop == ["END"]
    assert translate.chat_request(chat(stop=["\nObs", "END"]), "r", "", CFG).stop == ["\nObs", "END"]
    assert translate.chat_request(chat(), "r", "", CFG).stop == []


def test_unknown_model_is_404():
    e = rejected(translate.chat_request, chat(model="gpt-4o"), "r", "", CFG)
    assert (e.status, e.code, e.param) == (404, "model_not_found", "model")
    assert "gpt-4o" in e.message


@pytest.mark.parametrize("body,param", [
    ({"echo": True}, "echo"), ({"suffix": "x"}, "suffix"), ({"best_of": 2}, "best_of"), ({"logprobs": 1}, "logprobs"),
])
def test_completion_rules(body, param):
    req = decode(msgspec.json.encode({"model": "m", "prompt": "p", **body}), CompletionRequest)
    assert rejected(translate.completion_request, req, "r", "", CFG).param == param


def test_completion_prompt_must_be_one_string():
    e = rejected(decode, b'{"model": "m", "prompt": ["a", "b"]}', CompletionRequest)
    assert (e.status, e.param) == (400, "prompt")


# --- errors and config ----------------------------------------------------------------------------

def test_error_shape_and_backend_mapping():
    assert ApiError(401, "no", "invalid_api_key").body() == {
        "error": {"message": "no", "type": "authentication_error", "param": None, "code": "invalid_api_key"}}
    e = from_exception(NoResponders("sf.chat"))
    assert (e.status, e.code) == (503, "trajectory_unavailable") and "sf.chat" in e.message
    e = from_exception(BusUnavailable("not connected to NATS"))
    assert (e.status, e.code) == (503, "nats_unavailable") and "NATS" in e.message
    assert from_exception(ReplyTimeout("slow")).status == 504


def test_config_from_env():
    cfg = GatewayConfig()
    assert (cfg.port, cfg.admin_port, cfg.max_body_bytes) == (8000, 8001, 1024 * 1024)
    cfg = load(GatewayConfig, "SF_GATEWAY_", env={"SF_GATEWAY_API_KEYS": " a, b ,,", "SF_GATEWAY_PORT": "9"})
    assert cfg.static_keys() == ["a", "b"] and cfg.port == 9
    with pytest.raises(ConfigError):
        load(GatewayConfig, "SF_GATEWAY_", env={"SF_GATEWAY_PROT": "9"})


def test_openapi_is_generated_from_the_request_structs():
    doc = document(CFG)
    schemas = doc["components"]["schemas"]
    chat_schema = schemas["ChatCompletionRequest"]
    assert doc["openapi"].startswith("3.1")
    assert set(chat_schema["required"]) == {"model", "messages"}
    temp = chat_schema["properties"]["temperature"]["anyOf"][0]
    assert (temp["minimum"], temp["maximum"]) == (0.0, 2.0)
    assert {f.name for f in msgspec.structs.fields(ChatCompletionRequest)} == set(chat_schema["properties"])
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"] == "#/components/schemas/ChatCompletionRequest"


def test_logprobs_are_asked_for_on_the_wire():
    assert translate.chat_request(chat(logprobs=True), "r", "", CFG).logprobs
    assert not translate.chat_request(chat(), "r", "", CFG).logprobs


# --- what schema fuzzing found (tests/integration/test_gateway_fuzz.py) ----------------------------

def test_integer_valued_numbers_are_integers_as_json_schema_says():
    req = chat(top_logprobs=0.0, n=1.0, max_tokens=1e1, stop_token_ids=[1.0, 2])
    assert (req.top_logprobs, req.n, req.max_tokens, req.stop_token_ids) == (0, 1, 10, [1, 2])
    assert all(type(v) is int for v in (req.top_logprobs, req.n, req.max_tokens, *req.stop_token_ids))
    e = rejected(chat, top_logprobs=0.5)
    assert (e.status, e.param, e.code) == (400, "top_logprobs", "invalid_type")
    e = rejected(chat, top_logprobs=30.0)  # made an int, then out of range: that is the error shown
    assert (e.status, e.param, e.code) == (400, "top_logprobs", "invalid_value") and "<= 20" in e.message
    e = rejected(chat, seed=2.0, temperature="hot")
    assert e.param == "temperature"


def test_integers_fit_the_wire():
    for field, value in (("seed", 2**63), ("top_k", 2**31), ("stop_token_ids", [2**31])):
        assert rejected(chat, **{field: value}).status == 400
    for key in ("\u00b2", "99999999999", "-1", "1.5"):  # "²".isdigit() is True
        e = rejected(translate.chat_request, chat(logit_bias={key: 1}), "r", "", CFG)
        assert (e.status, e.param) == (400, "logit_bias")


def test_a_huge_integer_in_free_form_json_is_a_400_not_a_500():
    from services.gateway.service import wire

    tool = {"type": "function", "function": {"name": "f", "parameters": {"maximum": 2**70}}}
    req = translate.chat_request(chat(tools=[tool]), "r", "", CFG)
    e = rejected(wire, req)
    assert (e.status, e.code) == (400, "invalid_value")
    assert wire(translate.chat_request(chat(), "r", "", CFG))


def test_a_content_part_needs_its_type():
    e = rejected(chat, messages=[{"role": "user", "content": [{"text": "no type"}]}])
    assert (e.status, e.param, e.code) == (400, "messages[0].content[0].type", "missing_required_parameter")
    assert translate.chat_request(chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                             {"type": "text", "text": "b"}]}]),
                                  "r", "", CFG).messages == [{"role": "user", "content": "a\nb"}]


# --- the schema states what the gateway enforces: a body is valid against /openapi.json exactly when
# the gateway takes it, each refusal a typed 400 before any hop ----------------------------------------

SMALL = GatewayConfig(model="m", max_context=1024, max_tokens_limit=500, max_messages=2, max_tools=1)
TOOL = {"type": "function", "function": {"name": "f"}}


def _taken(body: dict, tp: type) -> ApiError | None:
    build = translate.chat_request if tp is ChatCompletionRequest else translate.completion_request
    try:
        build(decode(msgspec.json.encode(body), tp), "r", "", SMALL)
    except ApiError as e:
        return e
    return None


@pytest.mark.parametrize("tp,fields,param,code", [
    (CompletionRequest, {"prompt": ""}, "prompt", "invalid_value"),  # the rollout worker refuses it otherwise
    (ChatCompletionRequest, {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": ""}}},
     "tool_choice.function.name", "invalid_value"),
    (ChatCompletionRequest, {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice", "invalid_value"),  # the one rule the schema cannot state (tests/integration/fuzz_hooks.py)
    (ChatCompletionRequest, {"logit_bias": {"2147483648": 1}}, "logit_bias", "invalid_value"),
    (CompletionRequest, {"prompt": "p", "logit_bias": {"9999999999": 1}}, "logit_bias", "invalid_value"),
    (ChatCompletionRequest, {"max_tokens": 501, "max_completion_tokens": 10}, "max_tokens", "max_tokens_too_large"),
    (ChatCompletionRequest, {"max_completion_tokens": 1024}, "max_completion_tokens", "context_length_exceeded"),
    (ChatCompletionRequest, {"messages": [USER] * 3}, "messages", "too_many_messages"),
    (ChatCompletionRequest, {"tools": [TOOL, TOOL]}, "tools", "too_many_tools"),
    (ChatCompletionRequest, {"tools": [TOOL, TOOL], "tool_choice": "none"}, "tools", "too_many_tools"),
    (ChatCompletionRequest, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"x": 2**64}}}],
                             "tool_choice": "none"}, "tools", "invalid_value"),  # dropped, still the body's
])
def test_each_rule_is_a_typed_400_and_in_the_schema(tp, fields, param, code):
    import jsonschema

    body = {"model": "m", **({"messages": [USER]} if tp is ChatCompletionRequest else {}), **fields}
    e = _taken(body, tp)
    assert e is not None and (e.status, e.type, e.param, e.code) == (400, "invalid_request_error", param, code), e
    name = tp.__name__
    schema = jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}",
                                              "components": document(SMALL)["components"]})
    assert schema.is_valid(body) == (code == "invalid_value" and param == "tool_choice"), body


@pytest.mark.parametrize("tp,fields", [
    (CompletionRequest, {"prompt": " "}),
    (ChatCompletionRequest, {"logit_bias": {"2147483647": 1, "0007": -1, "0": 0}}),
    (ChatCompletionRequest, {"max_tokens": 500, "max_completion_tokens": 10}),
    (ChatCompletionRequest, {"messages": [USER] * 2, "tools": [TOOL],
                             "tool_choice": {"type": "function", "function": {"name": "f"}}}),
])
def test_what_the_schema_admits_the_gateway_takes(tp, fields):
    import jsonschema

    body = {"model": "m", **({"messages": [USER]} if tp is ChatCompletionRequest else {}), **fields}
    schema = jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{tp.__name__}",
                                              "components": document(SMALL)["components"]})
    assert schema.is_valid(body) and _taken(body, tp) is None, body
