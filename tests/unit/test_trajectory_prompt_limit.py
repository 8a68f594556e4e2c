"""The gateway's prompt-token limit (SF_GATEWAY_MAX_PROMPT_TOKENS), which rides on ChatRequest and
the trajectory manager checks, since only it tokenizes (services/trajectory/chat.py)."""

from __future__ import annotations

import pytest

from services.trajectory import chat
from services.trajectory.chat import TurnHandler
from services.trajectory.config import TrajectoryConfig
from tests.unit.test_trajectory_chat import FakeStore, renderer, request, run, table, worker  # noqa: F401


async def test_a_prompt_longer_than_the_gateway_allows_is_a_400_and_leaves_nothing(renderer):  # noqa: F811
    store = FakeStore()
    sid = await store.create_session()
    h = TurnHandler(TrajectoryConfig(worker_wait=2), store, renderer, table(), worker(renderer, "fine"))
    with pytest.raises(chat.TurnError) as e:
        await run(h, request("r1", sid, max_prompt_tokens=3))
    assert (e.value.status, e.value.code) == (400, "prompt_too_long") and "at most 3" in str(e.value)
    assert not store.saved and not store.requests
    done, _ = await run(h, request("r2", sid, max_prompt_tokens=4096))
    assert done.text == "fine"
