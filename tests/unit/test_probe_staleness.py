"""bench/probe_learning.py's staleness emulation: with `staleness` K, step t samples from the weights
the live policy had after step max(0, t - K), and at K = 0 from the live policy itself.
(The probe's runs are not in the suite: they take minutes.)"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.probe_learning import Behaviour  # noqa: E402


def step_to(model: torch.nn.Linear, version: int) -> None:
    with torch.no_grad():
        model.weight.fill_(float(version))


def test_step_t_samples_from_the_weights_of_step_t_minus_k():
    live = torch.nn.Linear(2, 2)
    step_to(live, 0)
    behaviour = Behaviour(live, 2)
    seen = []
    for step in range(6):
        policy = behaviour.policy(step)
        assert policy is not live
        seen.append((behaviour.version, float(policy.weight[0, 0])))
        step_to(live, step + 1)  # the trainer's step
        behaviour.stepped(step + 1)
    assert seen == [(0, 0.0), (0, 0.0), (0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0)]
    assert sorted(behaviour.states) == [4, 5, 6]  # older versions are dropped


def test_staleness_zero_samples_from_the_live_policy():
    live = torch.nn.Linear(2, 2)
    behaviour = Behaviour(live, 0)
    for step in range(3):
        assert behaviour.policy(step) is live and behaviour.version == step
        behaviour.stepped(step + 1)
    assert behaviour.states == {}
