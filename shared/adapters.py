"""LoRA adapter directories (PEFT's format), folded into a base checkpoint or taken out of a
trainer checkpoint. Used by the trainer (a version merged for publishing), the rollout worker
(what an adapter version is) and `seamlessflow export --merge/--adapter`.

    merge_into_base(base_dir, adapter_dir, out)     # a plain HF checkpoint: W + scaling * B @ A
    adapter_from_checkpoint(ckpt_root, out)         # the newest trainer checkpoint's adapter
    merged_state_dict(peft_state, scaling)          # the same fold on a PEFT model's state dict
    role_of(traj.metadata)                          # multi-LoRA: the agent role a session named

Multi-LoRA (one adapter per agent role): a session names its role in its metadata at creation
(`POST /v1/sessions {"metadata": {"role": "planner"}}`); the trajectory carries the metadata,
the trainer trains the role's adapter on it, and a version is a directory of one adapter dir
per role (`v%06d/<role>/`, shared/checkpoint.role_adapters).

An adapter directory holds adapter_config.json and adapter_model.safetensors with keys
`base_model.model.<layer>.lora_A.weight` / `.lora_B.weight`; peft's `PeftModel.from_pretrained`
and vLLM's `LoRARequest` load it as it is. The fold is done here in float64 and written
back in the base's dtype, on a copy: PEFT's in-place `merge_adapter()`/`unmerge_adapter()`
would leave a training model's weights off by rounding.

It knows files and tensors; not NATS, DeepSpeed's engine or vLLM. torch and safetensors
are imported where used, so importing this module stays cheap.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import Any

from shared.checkpoint import ADAPTER_CONFIG, CheckpointError, check_adapter, is_adapter, role_adapters

ADAPTER_WEIGHTS = "adapter_model.safetensors"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".index.json")
_PEFT_PREFIX = "base_model.model."
ROLE_KEY = "role"  # the session metadata field that names an agent's role
# a role names a directory, a vLLM LoRA and a metric: letters, digits and "_"
_ROLE_NAME = re.compile(r"[A-Za-z0-9_]{1,64}")

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "is_adapter", "check_adapter", "scaling_of", "merged_state_dict",
           "merge_into_base", "adapter_from_checkpoint", "copy_side_files", "adapter_rank", "ROLE_KEY",
           "role_of", "parse_roles", "role_adapters"]


def role_of(metadata: dict[str, Any]) -> str:
    """The role a session named in its metadata; "" for none (or one that is not a string)."""
    role = metadata.get(ROLE_KEY, "") if isinstance(metadata, dict) else ""
    return role if isinstance(role, str) else ""


def parse_roles(text: str) -> tuple[str, ...]:
    """"planner,solver" -> ("planner", "solver"); "" -> () (one adapter for every session)."""
    roles = tuple(r.strip() for r in text.split(",") if r.strip())
    bad = [r for r in roles if not _ROLE_NAME.fullmatch(r)]
    if bad:
        raise ValueError(f"role names are letters, digits and _ (at most 64): {bad}")
    if len(set(roles)) != len(roles):
        raise ValueError(f"a role is named twice: {text!r}")
    return roles


def scaling_of(config: dict) -> float:
    """PEFT's LoRA scaling: alpha / r (alpha / sqrt(r) for rsLoRA)."""
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _split(peft_state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """PEFT names -> (plain HF tensors, {layer: {"A": .., "B": ..}})."""
    plain: dict[str, Any] = {}
    lora: dict[str, dict[str, Any]] = {}
    for key, t in peft_state.items():
        name = key.removeprefix(_PEFT_PREFIX)
        if ".lora_A." in name or ".lora_B." in name:
            which = "A" if ".lora_A." in name else "B"
            lora.setdefault(name.split(f".lora_{which}.")[0], {})[which] = t
        elif ".lora_" in name:  # lora_embedding_*, lora_magnitude_* (DoRA): not offered
            raise CheckpointError(f"cannot merge {key}: only lora_A/lora_B of linear layers are supported")
        else:
            plain[name.replace(".base_layer.", ".")] = t
    return plain, lora


def _fold(w, ab: dict[str, Any], scaling: float):
    return (w.double() + (ab["B"].double() @ ab["A"].double()) * scaling).to(w.dtype)


def merged_state_dict(peft_state: dict[str, Any], scaling: float) -> dict[str, Any]:
    """A PEFT model's full state dict -> the plain HF state dict with each adapter folded in."""
    out, lora = _split(peft_state)
    for layer, ab in lora.items():
        out[f"{layer}.weight"] = _fold(out[f"{layer}.weight"], ab, scaling)
    return out


def copy_side_files(src: Path, out: Path) -> None:
    """Tokenizer, chat template, config: whatever the weights do not cover."""
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and not (out / f.name).exists():
            shutil.copy2(f, out / f.name)


def merge_into_base(base_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path) -> Path:
    """Base HF checkpoint + adapter dir -> a merged HF checkpoint at `out_dir` (written beside it
    and renamed into place), tensor for tensor in the base's files, names and dtypes."""
    from safetensors.torch import load_file, save_file

    base, adapter, out = Path(base_dir), Path(adapter_dir), Path(out_dir)
    check_adapter(adapter)
    config = json.loads((adapter / ADAPTER_CONFIG).read_text())
    _, lora = _split(load_file(str(adapter / ADAPTER_WEIGHTS)))
    pending = {f"{layer}.weight": ab for layer, ab in lora.items()}
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    files = sorted(base.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{base}: no *.safetensors files")
    for f in files:
        tensors = load_file(str(f))
        for name in list(tensors):
            if name in pending:
                tensors[name] = _fold(tensors[name], pending.pop(name), scaling_of(config))
        save_file(tensors, str(tmp / f.name), metadata={"format": "pt"})
    if pending:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{adapter}: adapts layers the base has not: {sorted(pending)[:3]}")
    copy_side_files(base, tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def adapter_from_checkpoint(root: str | Path, out_dir: str | Path, role: str = "") -> Path:
    """The adapter of the newest trainer checkpoint under `root` (its `latest` tag) as a PEFT
    adapter dir. The trainer writes adapter_config.json into each LoRA checkpoint's tag dir
    (multi-LoRA: into `<tag>/<role>/`, and `role` picks one);
    the tensors are read from DeepSpeed's model states (ZeRO 0-2) or gathered from the ZeRO-3
    shards."""
    import torch
    from safetensors.torch import save_file

    root = Path(root)
    try:
        tag = (root / "latest").read_text().strip()
    except OSError as e:
        raise CheckpointError(f"{root}: no trainer checkpoint ('latest' missing): {e}") from None
    tag_dir = root / tag
    config_dir = tag_dir
    if not is_adapter(tag_dir):
        roles = role_adapters(tag_dir, files_ok=True)
        if not roles:
            raise CheckpointError(f"{tag_dir}: not a LoRA checkpoint (no {ADAPTER_CONFIG})")
        if role not in roles:
            raise CheckpointError(f"{tag_dir}: a multi-LoRA checkpoint; name one of its roles {sorted(roles)}")
        config_dir = roles[role]
    name = f".{role or 'default'}."
    states = tag_dir / "mp_rank_00_model_states.pt"  # ZeRO 0-2; ZeRO-3 writes per-rank shards instead
    module = torch.load(states, map_location="cpu", weights_only=False)["module"] if states.exists() else {}
    if not module:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        module = get_fp32_state_dict_from_zero_checkpoint(str(root), tag=tag, exclude_frozen_parameters=True)
    tensors = {k.replace(name, "."): v.detach().to("cpu").contiguous()
               for k, v in module.items() if f".lora_A{name}" in k or f".lora_B{name}" in k}
    if not tensors:
        raise CheckpointError(f"{tag_dir}: no adapter tensors in the checkpoint")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    shutil.copy2(config_dir / ADAPTER_CONFIG, out / ADAPTER_CONFIG)
    check_adapter(out)
    return out


def adapter_rank(adapter_dir: str | Path) -> int:
    return int(json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text())["r"])
