"""services/rollout/refill.py: which trainer offer refills an engine (pure). The bounded retry runs
against the real Engine and service in test_rollout_service.py."""

from __future__ import annotations

from services.rollout.refill import refusal
from shared.messages.weights import WeightsPublished, WeightTransfer

ROUND = WeightTransfer("10.0.0.1", 29500, "c-w")


def offer(version: int, transfer: WeightTransfer | None = ROUND) -> WeightsPublished:
    return WeightsPublished(version, "", 0.0, 0, transfer)


def test_a_refill_takes_the_same_version_back_or_a_newer_one():
    assert refusal(offer(3), 3, refill=True) == ""
    assert refusal(offer(4), 3, refill=True) == ""
    assert "not newer" in refusal(offer(2), 3, refill=True)  # never back to an older version


def test_a_catch_up_takes_only_a_newer_version():
    assert refusal(offer(4), 3, refill=False) == ""
    assert "not newer" in refusal(offer(3), 3, refill=False)


def test_not_now_is_refused_either_way():
    for refill in (True, False):
        assert "no round now (its version 5)" in refusal(offer(5, None), 3, refill=refill)
