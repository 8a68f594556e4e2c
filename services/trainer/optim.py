"""The trainer's optimizer: a torch AdamW whose param groups can sit a step out.

    opt, idle = adamw(cfg, {"": params})                    # one group: full fine-tune or one adapter
    opt, idle = adamw(cfg, {"planner": ps, "solver": qs})   # multi-LoRA: one group per role (group["role"])
    idle.roles = frozenset({"solver"})                      # the next optimizer steps leave solver's group alone

Why a group sits out rather than takes a zero step: AdamW moves a parameter whose gradient is
zero (the momentum of earlier steps, the decoupled weight decay) and advances its state (the step
count, both moments decay). A role with no samples in a step must come out of it as it went in,
so its group is not stepped at all: its parameters and its Adam state (step, exp_avg,
exp_avg_sq) stay bit for bit, and its next real step continues as if the idle step had not been.
What does advance for every group is what is global: the lr schedule (warm-up counts steps of the
trainer, not of a role) and DeepSpeed's step counter.

How: torch's optimizers skip a parameter whose `.grad` is None (no update, no state). A step
pre-hook takes the gradient off every parameter of a sitting-out group and the post-hook puts
it back. The hooks look at `param_groups` as the step sees it, which is what makes this hold
under DeepSpeed at every stage the multi-LoRA trainer runs (0-2), because DeepSpeed steps this
very optimizer there and keeps each group's dict (and its "role"):
- ZeRO 0, fp32: the optimizer as it is, on the model's parameters;
- ZeRO 0, bf16 (FP16_UnfusedOptimizer, for a torch optimizer): each group's "params" become fp32
  master copies of its parameters;
- ZeRO 1-2 (DeepSpeedZeroOptimizer): each group's "params" become this rank's flat fp32
  partition, and each group is stepped alone (`param_groups` set to that one group).
The wrappers then copy every group's master into the model's weights: a skipped group's master
is unchanged, so its weights are rewritten with the values they already hold. The grad-norm and
clipping still count the idle group (its gradient is an exact zero: it adds nothing).
Not covered: DeepSpeed's own optimizers (FusedAdam, DeepSpeedCPUAdam, ZeRO-Offload's CPU Adam),
which the trainer does not build (engine.py: a client optimizer, and no optimizer offload).

It does not know DeepSpeed's classes, LoRA or batches: the engine says which roles sit out.
"""

from __future__ import annotations

import torch


class SitOut:
    """The roles whose param groups the next optimizer steps leave alone (`roles`, set per train step)."""

    def __init__(self, opt: torch.optim.Optimizer):
        self.roles: frozenset[str] = frozenset()
        self._held: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        opt.register_step_pre_hook(self._take)
        opt.register_step_post_hook(self._give_back)

    def _take(self, opt: torch.optim.Optimizer, args, kwargs) -> None:
        self._give_back(opt, args, kwargs)  # a step that raised left its grads held: put them back first
        if not self.roles:
            return
        for group in opt.param_groups:
            if group.get("role") in self.roles:
                for p in group["params"]:
                    self._held.append((p, p.grad))
                    p.grad = None

    def _give_back(self, opt: torch.optim.Optimizer, args, kwargs) -> None:
        for p, grad in self._held:
            p.grad = grad
        self._held.clear()


def adamw(cfg, groups: dict[str, list[torch.nn.Parameter]]) -> tuple[torch.optim.AdamW, SitOut]:
    """An AdamW with one param group per key of `groups` (its "role"), and the switch that lets groups sit out."""
    if not groups or any(not ps for ps in groups.values()):
        raise ValueError(f"every param group needs parameters: {sorted(groups)}")
    opt = torch.optim.AdamW([{"params": ps, "role": role} for role, ps in groups.items()], lr=cfg.lr,
                            betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
    return opt, SitOut(opt)
