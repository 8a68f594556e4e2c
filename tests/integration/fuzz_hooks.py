"""Schemathesis hooks for test_gateway_fuzz: the rules of the agent API that JSON Schema cannot
state, each with its reason. A generated body that breaks one is left out, so that it is not
counted as a schema-valid request rejected; the gateway answers it with a typed 400 (its unit
test is named beside the rule). Everything else the gateway refuses is in the document
(services/gateway/openapi.py, served_subset).

Not listed, because a fuzzer cannot reach them: `previous_response_id` names a stored response
(a random one is a 404, which positive_data_acceptance allows), and its stored conversation
counts towards SF_GATEWAY_MAX_MESSAGES; the body's size in bytes (SF_GATEWAY_MAX_BODY_BYTES,
413) is no JSON Schema keyword.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import schemathesis


def _names(tools: Any) -> set[str]:
    names = set()
    for tool in tools if isinstance(tools, list) else []:
        if isinstance(tool, dict):
            fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool  # chat | Responses
            if isinstance(fn.get("name"), str):
                names.add(fn["name"])
    return names


def names_a_tool_it_lacks(body: Any) -> bool:
    if not isinstance(body, dict) or not isinstance(body.get("tool_choice"), dict):
        return False
    choice = body["tool_choice"]
    named = choice.get("function", {}).get("name") if isinstance(choice.get("function"), dict) else choice.get("name")
    return isinstance(named, str) and named not in _names(body.get("tools"))


# rule -> (does this body break it, why JSON Schema cannot say it)
UNSTATABLE: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tool_choice names one of tools": (
        names_a_tool_it_lacks,
        "a value must equal a value elsewhere in the body; JSON Schema compares values only to constants "
        "(the gateway: 400 invalid_value, param tool_choice; tests/unit: test_gateway_schemas.test_tool_choice, "
        "test_gateway_responses.test_bad_input_is_a_typed_error)"),
}


def breaks_a_rule(body: Any) -> str | None:
    return next((rule for rule, (breaks, _) in UNSTATABLE.items() if breaks(body)), None)


@schemathesis.hook
def filter_case(ctx, case) -> bool:  # filter_case, not filter_body: the coverage phase runs only case hooks
    return breaks_a_rule(case.body) is None
