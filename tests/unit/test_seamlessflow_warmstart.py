"""The warm start's stopping rule (seamlessflow/warmstart.py), with the sampled check replaced:
coarse checks every CHECK_EVERY steps, then, past half the target, a quarter of the lr and a
larger check after every step, stopping at the first check at or above the target. The
supervised steps are real (the tiny model), so the saved model is a loadable checkpoint."""

from __future__ import annotations

import pytest

from seamlessflow import warmstart


@pytest.fixture
def checks(monkeypatch):
    """Replace the sampled check: it returns the next scripted reward and records its sample count."""
    seen: list[int] = []
    script: list[float] = []

    def fake(model, tok, rng, n=64, max_new=8, task="reverse"):
        seen.append(n)
        return script.pop(0)

    monkeypatch.setattr(warmstart, "sampled_reward", fake)
    return script, seen


def test_past_half_the_target_it_checks_every_step_with_more_samples_and_stops_at_the_target(
        tiny_model, tmp_path, checks):
    script, seen = checks
    script += [0.0, 0.1, 0.3, 0.45, 0.52]  # step 0, 5, 10 (past 0.25), 11, 12 (>= 0.5)
    lines: list[str] = []
    out = warmstart.warm_start(tiny_model, tmp_path / "sft", target_reward=0.5, max_steps=100, batch=4,
                               log=lines.append)
    assert out == {"steps": 12, "sampled_reward": 0.52}
    assert seen == [64, 64, 64, 128, 128]
    assert any("past half the target: lr 0.00025" in line for line in lines), lines
    assert (tmp_path / "sft" / "config.json").exists() and not (tmp_path / "sft.tmp").exists()


def test_without_fine_checks_it_keeps_the_coarse_rule(tiny_model, tmp_path, checks):
    """The learning test's settings (fine=False): every `check_every` steps, one lr, 64 samples."""
    script, seen = checks
    script += [0.0, 0.2, 0.31]
    out = warmstart.warm_start(tiny_model, tmp_path / "sft", target_reward=0.3, check_every=3, fine=False,
                               batch=4, log=lambda line: None)
    assert out["steps"] == 6 and seen == [64, 64, 64]
