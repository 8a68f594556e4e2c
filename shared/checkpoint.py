"""What a weight directory holds, read without loading it: tensor specs from the
safetensors headers.

A PEFT LoRA adapter directory (adapter_config.json) is checked as an adapter instead:
its rank and tensors, not the base model's names.

A failed in-place reload leaves vLLM dead (docs/environment.md), so a directory is checked
here first: config.json parses, every *.safetensors file is whole and readable, and
its tensors have the names and shapes of the checkpoint the engine started from.
The trainer checks each snapshot before announcing it, the operator CLI before publishing,
and a rollout worker before loading it in place. This module knows files only; it does
not know vLLM, torch or NATS.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

TensorSpecs = dict[str, tuple[str, tuple[int, ...]]]  # name -> (dtype, shape)

_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit


class CheckpointError(ValueError):
    pass


def _read_header(path: Path) -> TensorSpecs:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path.name}: shorter than a safetensors header")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(f"{path.name}: header length {n} does not fit a {size}-byte file")
            header = json.loads(f.read(n))
    except OSError as e:
        raise CheckpointError(f"{path.name}: cannot read: {e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path.name}: bad header: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path.name}: bad header: not an object")
    specs: TensorSpecs = {}
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (lo, hi) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path.name}: bad header entry for {name!r}") from None
        if not 0 <= lo <= hi:
            raise CheckpointError(f"{path.name}: bad data offsets for {name!r}")
        specs[name] = (dtype, shape)
        end = max(end, hi)
    if 8 + n + end != size:
        raise CheckpointError(f"{path.name}: {size} bytes on disk, the header describes {8 + n + end} (truncated?)")
    return specs


def tensor_specs(model_dir: str | Path) -> TensorSpecs:
    """Every tensor in the directory's *.safetensors files. Raises CheckpointError."""
    d = Path(model_dir)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{d}: no *.safetensors files")
    specs: TensorSpecs = {}
    for f in files:
        for name, spec in _read_header(f).items():
            if name in specs:
                raise CheckpointError(f"{d}: tensor {name!r} appears in more than one file")
            specs[name] = spec
    return specs


def check_checkpoint(model_dir: str | Path, reference: TensorSpecs | None = None) -> TensorSpecs:
    """Raise CheckpointError unless `model_dir` looks loadable in place of `reference`.

    Each reference tensor must be present with the same shape. The dtype may
    differ (a trainer may save bf16 for an fp32 engine; vLLM converts on load).
    """
    d = Path(model_dir)
    if not d.is_dir():
        raise CheckpointError(f"{d}: not a directory")
    if is_adapter(d):
        return check_adapter(d)
    if roles := role_adapters(d):  # multi-LoRA: one adapter per role, each checked as an adapter
        return {f"{role}/{name}": spec for role, sub in roles.items() for name, spec in check_adapter(sub).items()}
    try:
        config = json.loads((d / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{d}/config.json: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{d}/config.json: not an object")
    specs = tensor_specs(d)
    if reference is not None:
        missing = sorted(set(reference) - set(specs))
        if missing:
            raise CheckpointError(f"{d}: missing tensors {missing[:5]}{'...' if len(missing) > 5 else ''}")
        for name, (_, shape) in reference.items():
            if specs[name][1] != shape:
                raise CheckpointError(f"{d}: {name} has shape {list(specs[name][1])}, expected {list(shape)}")
    return specs


ADAPTER_CONFIG = "adapter_config.json"  # a PEFT LoRA adapter directory (a LoRA trainer's version)


def is_adapter(model_dir: str | Path) -> bool:
    return (Path(model_dir) / ADAPTER_CONFIG).is_file()


def role_adapters(model_dir: str | Path, files_ok: bool = False) -> dict[str, Path]:
    """A multi-LoRA version (one adapter per agent role): role -> its adapter dir, sorted by role;
    {} for anything else. Such a version dir holds no files of its own, only `<role>/` adapter dirs
    (`files_ok`: a trainer checkpoint's tag dir, whose files are DeepSpeed's, beside the roles' configs).
    A checkpoint root (a `latest` file beside tag dirs) is not one."""
    d = Path(model_dir)
    if not d.is_dir() or is_adapter(d):
        return {}
    entries = list(d.iterdir())
    if not files_ok and any(not p.is_dir() for p in entries):
        return {}
    subs = sorted(p for p in entries if p.is_dir())
    return {p.name: p for p in subs} if subs and all(is_adapter(p) for p in subs) else {}


def is_adapter_version(model_dir: str | Path) -> bool:
    """A LoRA trainer's version: one adapter dir, or one per role."""
    return is_adapter(model_dir) or bool(role_adapters(model_dir))


def check_adapter(adapter_dir: str | Path) -> TensorSpecs:
    """Raise CheckpointError unless `adapter_dir` is a whole PEFT LoRA adapter: its config names
    a rank and target modules, and its safetensors hold lora_A/lora_B pairs of that rank."""
    d = Path(adapter_dir)
    try:
        config = json.loads((d / ADAPTER_CONFIG).read_text())
        rank = int(config["r"])
        targets = config["target_modules"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{d}/{ADAPTER_CONFIG}: {type(e).__name__}: {e}") from None
    if rank < 1 or not targets:
        raise CheckpointError(f"{d}/{ADAPTER_CONFIG}: rank {rank}, target modules {targets!r}")
    specs = tensor_specs(d)
    for name, (_, shape) in specs.items():
        if ".lora_A." in name and shape[0] != rank or ".lora_B." in name and shape[-1] != rank:
            raise CheckpointError(f"{d}: {name} has shape {list(shape)}, not of rank {rank}")
    if not any(".lora_A." in n for n in specs):
        raise CheckpointError(f"{d}: no lora_A tensors")
    return specs
