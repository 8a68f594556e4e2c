"""sf.session.<op>: session lifecycle, gateway -> trajectory manager (request/reply)."""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class SessionRequest(msgspec.Struct, tag=True, omit_defaults=True):
    op: Literal["create", "get", "reward", "finish"]
    session_id: str = ""
    group_id: str = ""
    metadata: dict[str, Any] = {}
    reward: float | None = None


class SessionReply(msgspec.Struct, omit_defaults=True):
    """`status` follows HTTP: 200 ok, 404 unknown session, 409 conflict, 400 bad input, 429 not now
    (admission), 503 not yet (a finish whose trajectory is still being published)."""

    status: int
    session_id: str = ""
    message: str = ""
    body: dict[str, Any] = {}
    retry_after: float = 0.0  # seconds; > 0 on a refusal worth retrying (429, 503): the HTTP Retry-After
    code: str = ""  # the OpenAI error code the gateway answers with; "" = its default for the status
