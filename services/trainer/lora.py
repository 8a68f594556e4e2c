"""LoRA on the trainer: which modules get an adapter, and what an adapter version is on disk.

    spec = lora_spec(cfg)                 # None when SF_TRAINER_LORA_RANK=0 (full fine-tune)
    model = wrap(model, spec)             # a PEFT model; only lora_A/lora_B require grad
    with adapter_disabled(module): ...    # the base policy: the KL reference, no second copy
    save_adapter(module, out, state)      # a PEFT adapter dir that peft and vLLM load as they are

Multi-LoRA (`SF_TRAINER_LORA_ROLES=planner,solver`): one named PEFT adapter per role,
`wrap(model, spec, roles=...)`. Every adapter's parameters require grad all the time (the
optimizer and DeepSpeed see one fixed set); `activate(module, role)` picks the adapter the
next forward runs through without touching requires_grad, so a role's micro-batch puts
gradient into its adapter alone, and `idle_term` (0 x the other adapters) gives the others an
exact zero gradient, the same parameters in every backward on every rank. A zero gradient
still lets AdamW move an adapter (momentum, weight decay): a role with no samples in a step
sits the optimizer step out instead (optim.py).

A version published under LoRA is an adapter directory (adapter_config.json +
adapter_model.safetensors, a few MB). Folding an adapter into the base
(`lora_publish=merged`, `seamlessflow export --merge`) is shared/adapters.py's.

It does not know DeepSpeed, NATS or versions: the engine gathers the tensors (ZeRO-3)
and passes them in.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import msgspec
import torch

from shared.adapters import ADAPTER_WEIGHTS

# target-module sets offered by name (Llama-family projection names, which vLLM's LoRA layers cover too)
TARGET_SETS: dict[str, tuple[str, ...]] = {
    "attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
    "all": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}


class LoraSpec(msgspec.Struct, frozen=True):
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def target_modules(targets: str) -> tuple[str, ...]:
    """A set's name ("attn", "mlp", "all") or a comma-separated list of module names."""
    if targets in TARGET_SETS:
        return TARGET_SETS[targets]
    names = tuple(t.strip() for t in targets.split(",") if t.strip())
    if not names:
        raise ValueError(f"lora_targets {targets!r}: name a set ({', '.join(TARGET_SETS)}) or list module names")
    return names


def lora_spec(cfg) -> LoraSpec | None:
    """The LoRA settings of a TrainerConfig, or None for a full fine-tune (lora_rank=0)."""
    if cfg.lora_rank == 0:
        return None
    return LoraSpec(rank=cfg.lora_rank, alpha=cfg.lora_alpha or float(2 * cfg.lora_rank),
                    dropout=cfg.lora_dropout, targets=target_modules(cfg.lora_targets))


def peft_config(spec: LoraSpec, base_dir: str = ""):
    from peft import LoraConfig

    return LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                      target_modules=list(spec.targets), bias="none", task_type="CAUSAL_LM",
                      base_model_name_or_path=base_dir or None)


DEFAULT = "default"  # PEFT's name of a lone adapter


def wrap(model: torch.nn.Module, spec: LoraSpec, base_dir: str = "", roles: tuple[str, ...] = ()) -> torch.nn.Module:
    """A PEFT model around `model`: base weights frozen, lora_B zero (the adapter starts as a no-op).
    With `roles`, one adapter per role, named after it, all trainable, the first active."""
    from peft import get_peft_model

    names = roles or (DEFAULT,)
    peft_model = get_peft_model(model, peft_config(spec, base_dir), adapter_name=names[0])
    for name in names[1:]:
        peft_model.add_adapter(name, peft_config(spec, base_dir))
    if roles:
        for n, p in peft_model.named_parameters():
            if _adapter_of(n) is not None:
                p.requires_grad_(True)  # add_adapter leaves the inactive ones frozen
        activate(peft_model, names[0])
    return peft_model


def _adapter_of(param_name: str) -> str | None:
    """`...q_proj.lora_A.planner.weight` -> "planner"; None for a base parameter."""
    for part in (".lora_A.", ".lora_B."):
        if part in param_name:
            return param_name.split(part, 1)[1].split(".", 1)[0]
    return None


def adapter_params(module: torch.nn.Module) -> dict[str, list[torch.nn.Parameter]]:
    """Each adapter's parameters, by adapter name."""
    out: dict[str, list[torch.nn.Parameter]] = {}
    for n, p in module.named_parameters():
        if (name := _adapter_of(n)) is not None:
            out.setdefault(name, []).append(p)
    return out


def activate(module: torch.nn.Module, role: str) -> None:
    """Run the next forwards through `role`'s adapter. PEFT's own `set_adapter` also flips
    requires_grad, which would change the parameter set DeepSpeed reduces; this does not."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    base = getattr(module, "base_model", None)
    if base is None or getattr(base, "active_adapter", None) == role:
        return
    if role not in module.peft_config:
        raise KeyError(f"no adapter for role {role!r} (adapters: {sorted(module.peft_config)})")
    for m in module.modules():
        if isinstance(m, BaseTunerLayer):
            m._active_adapter = [role]  # noqa: SLF001  what BaseTunerLayer.set_adapter sets, minus requires_grad
    base.active_adapter = role


def active(module: torch.nn.Module) -> str:
    """The adapter the next forward runs through."""
    return module.base_model.active_adapter


def idle_term(params: dict[str, list[torch.nn.Parameter]], role: str) -> torch.Tensor | float:
    """0 x the sum of every other adapter's parameters: added to a loss, it gives them a zero
    gradient, so each backward produces a gradient for the same parameters (ZeRO 1-2 reduce
    them in hook order, which must agree across ranks)."""
    idle = [p.sum() for name, ps in params.items() if name != role for p in ps]
    return 0.0 * torch.stack(idle).sum() if idle else 0.0


def adapter_disabled(module: torch.nn.Module):
    """A context in which `module` computes the base policy (a no-op for a plain model)."""
    disable = getattr(module, "disable_adapter", None)
    return disable() if callable(disable) else contextlib.nullcontext()


def trainable_state(module: torch.nn.Module, adapter: str = DEFAULT) -> dict[str, torch.Tensor]:
    """One adapter's tensors under PEFT's saved names (`...q_proj.lora_A.weight`), on CPU."""
    from peft import get_peft_model_state_dict

    state = {n: p.detach().to("cpu", copy=True) for n, p in module.named_parameters()
             if p.requires_grad and _adapter_of(n) == adapter}
    return get_peft_model_state_dict(module, state_dict=state, adapter_name=adapter)


def save_adapter(module: torch.nn.Module, out_dir: str | Path, state: dict[str, torch.Tensor],
                 adapter: str = DEFAULT) -> Path:
    """Write a PEFT adapter directory: adapter_config.json + adapter_model.safetensors."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = module.peft_config[adapter]
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config.save_pretrained(str(out))
    return out


def save_adapter_config(module: torch.nn.Module, out_dir: str | Path, adapter: str = DEFAULT) -> None:
    """adapter_config.json alone: beside a checkpoint's tensors, what export needs to rebuild the adapter."""
    module.peft_config[adapter].save_pretrained(str(out_dir))
