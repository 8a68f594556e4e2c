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


def test_a_lora_policy_samples_from_its_adapter_k_steps_back(tiny_model):
    """With LoRA the behaviour copy is the PEFT model: step t samples with the adapter as it was after
    step t - K, not the live one, and not the bare base (issue 27's screen at the demo's staleness)."""
    from bench.probe_learning import DEFAULTS, build_policy

    model, _opt, _sched, _ref = build_policy({**DEFAULTS, "model": str(tiny_model), "lora_rank": 8})
    b_name = next(n for n, p in model.named_parameters() if ".lora_B.default." in n)

    def set_b(m, version: int) -> None:
        with torch.no_grad():
            dict(m.named_parameters())[b_name].fill_(0.125 * version)

    behaviour = Behaviour(model, 1)
    x = torch.tensor([[5, 6, 7, 8]])
    logits = {}
    for step in range(3):
        policy = behaviour.policy(step)
        assert policy is not model and float(dict(policy.named_parameters())[b_name][0, 0]) == 0.125 * behaviour.version
        with torch.no_grad():
            logits[step] = policy(x).logits
        set_b(model, step + 1)
        behaviour.stepped(step + 1)
    with torch.no_grad():
        assert torch.equal(logits[2], model(x).logits) is False  # the live adapter has moved on (version 3)
        set_b(model, 1)
        assert torch.allclose(logits[2], model(x).logits)  # step 2 sampled with version 1's adapter
