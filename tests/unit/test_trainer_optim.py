"""services/trainer/optim.py: a param group that sits a step out keeps its parameters and its Adam
state bit for bit, on the optimizer as it is and as DeepSpeed's ZeRO 1-2 wrapper steps it (each
group's params replaced by one flat fp32 partition, each group stepped alone). The DeepSpeed runs
themselves are in tests/integration/test_trainer_multilora.py."""

from __future__ import annotations

import types

import pytest
import torch

from services.trainer import optim

CFG = types.SimpleNamespace(lr=0.1, beta1=0.9, beta2=0.999, adam_eps=1e-8, weight_decay=0.1)


def params() -> dict[str, list[torch.nn.Parameter]]:
    torch.manual_seed(0)
    return {"a": [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))],
            "b": [torch.nn.Parameter(torch.randn(5))]}


def grads(groups, zero: str = "") -> None:
    for role, ps in groups.items():
        for p in ps:  # an idle role's gradient is an exact zero (lora.idle_term), not None
            p.grad = torch.zeros_like(p) if role == zero else torch.randn_like(p)


def snapshot(opt, role: str):
    [group] = [g for g in opt.param_groups if g["role"] == role]
    return [(p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}) for p in group["params"]]


def same(x, y) -> bool:
    return all(torch.equal(p, q) and x_s.keys() == y_s.keys() and all(torch.equal(x_s[k], y_s[k]) for k in x_s)
               for (p, x_s), (q, y_s) in zip(x, y))


def zero_style(opt, groups) -> None:
    """What DeepSpeedZeroOptimizer does to the client optimizer: each group's params become one flat
    fp32 tensor (this rank's partition), the group dict kept; grads are set on the flat tensor."""
    for group, ps in zip(opt.param_groups, groups.values()):
        group["params"] = [torch.nn.Parameter(torch.cat([p.detach().flatten() for p in ps]))]


def zero_step(opt) -> None:
    """DeepSpeedZeroOptimizer._optimizer_step: each group alone."""
    original = opt.param_groups
    for i in range(len(original)):
        opt.param_groups = [original[i]]
        opt.step()
        opt.param_groups = original


def flat_grads(opt, zero: str = "") -> None:
    for g in opt.param_groups:
        [p] = g["params"]
        p.grad = torch.zeros_like(p) if g["role"] == zero else torch.randn_like(p)


def test_a_group_that_sits_out_keeps_its_parameters_and_state():
    groups = params()
    opt, idle = optim.adamw(CFG, groups)
    assert [g["role"] for g in opt.param_groups] == ["a", "b"]
    grads(groups)
    opt.step()  # both roles train: b has momentum now
    a1, b1 = snapshot(opt, "a"), snapshot(opt, "b")
    idle.roles = frozenset({"b"})
    grads(groups, zero="b")
    opt.step()
    assert same(snapshot(opt, "b"), b1)  # weights, step count, both moments
    assert not same(snapshot(opt, "a"), a1)
    assert float(opt.state[groups["a"][0]]["step"]) == 2 and float(opt.state[groups["b"][0]]["step"]) == 1
    assert all(p.grad is not None and not p.grad.any() for p in groups["b"])  # its gradient is put back


def test_without_sitting_out_a_zero_gradient_still_moves_the_group():
    """The defect the switch removes: momentum and weight decay move a parameter whose gradient is zero."""
    groups = params()
    opt, _ = optim.adamw(CFG, groups)
    grads(groups)
    opt.step()
    b1 = snapshot(opt, "b")
    grads(groups, zero="b")
    opt.step()
    assert not torch.equal(snapshot(opt, "b")[0][0], b1[0][0])


def test_sitting_out_holds_as_deepspeed_zero_steps_the_optimizer():
    groups = params()
    opt, idle = optim.adamw(CFG, groups)
    zero_style(opt, groups)
    flat_grads(opt)
    zero_step(opt)
    a1, b1 = snapshot(opt, "a"), snapshot(opt, "b")
    idle.roles = frozenset({"b"})
    flat_grads(opt, zero="b")
    zero_step(opt)
    assert same(snapshot(opt, "b"), b1)
    assert not same(snapshot(opt, "a"), a1)
    idle.roles = frozenset()  # the next step with b's samples: b moves again
    flat_grads(opt)
    zero_step(opt)
    assert not same(snapshot(opt, "b"), b1)


def test_a_group_that_never_trained_gets_no_state():
    groups = params()
    opt, idle = optim.adamw(CFG, groups)
    idle.roles = frozenset({"b"})
    before = snapshot(opt, "b")
    grads(groups, zero="b")
    opt.step()  # AdamW's first step would apply weight decay to b
    assert same(snapshot(opt, "b"), before) and not opt.state[groups["b"][0]]
    # a checkpoint of it round-trips (torch keeps no state for b)
    fresh, _ = optim.adamw(CFG, params())
    fresh.load_state_dict(opt.state_dict())
    assert [g["role"] for g in fresh.param_groups] == ["a", "b"]


def test_a_step_that_raised_gives_the_gradients_back_at_the_next():
    groups = params()
    opt, idle = optim.adamw(CFG, groups)
    idle.roles = frozenset({"b"})
    grads(groups, zero="b")

    def boom():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        opt.step(boom)
    assert groups["b"][0].grad is None
    idle.roles = frozenset()
    opt.step()
    assert groups["b"][0].grad is not None


def test_every_group_needs_parameters():
    with pytest.raises(ValueError, match="parameters"):
        optim.adamw(CFG, {"a": [torch.nn.Parameter(torch.zeros(1))], "b": []})
