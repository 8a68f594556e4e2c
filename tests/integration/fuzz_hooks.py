"""Schemathesis hooks for test_gateway_fuzz: the one rule of the agent API that JSON Schema
cannot state. A named `tool_choice` must name one of the request's `tools` (OpenAI answers
400 otherwise, and so does the gateway), so generated bodies that break it are not counted
as schema-valid requests rejected. Everything else the gateway refuses is in the document
(services/gateway/openapi.py, served_subset)."""

from __future__ import annotations

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


@schemathesis.hook
def filter_case(ctx, case) -> bool:  # filter_case, not filter_body: the coverage phase runs only case hooks
    return not names_a_tool_it_lacks(case.body)
