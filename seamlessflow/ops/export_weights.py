"""`seamlessflow export --merge SRC` / `--adapter SRC` / `--checkpoint SRC`: weights out of the system.

    seamlessflow export --adapter var/weights/v000012 --out my-adapter     # PEFT adapter dir
    seamlessflow export --adapter var/trainer/checkpoints --out my-adapter # newest checkpoint's
    seamlessflow export --merge var/weights/v000012 --out merged-model     # base + adapter, plain HF
    seamlessflow export --adapter var/weights/v000012 --role solver --out solver-adapter  # multi-LoRA
    seamlessflow export --checkpoint var/trainer/checkpoints --model var/model --out v-hf  # full fine-tune

SRC is an adapter version (what a LoRA trainer publishes into the weight store) or a LoRA
trainer's checkpoint dir (its `latest` tag). `--merge` folds the adapter into the base
checkpoint named by `--model`, else by the adapter's `base_model_name_or_path`.

`--checkpoint` is a full fine-tune's trainer checkpoint dir: its newest tag's weights as a plain
HF checkpoint (the base's file layout, names and dtypes; config and tokenizer from `--model`), with
`sf_export.json` naming the tag, step and weight version it holds. Under network weights
(SF_TRAINER_WEIGHTS_TRANSPORT=network) no version dir exists, and this is how a version leaves
the system: the checkpoint written after step S holds the weights the round of that step sent.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from shared import adapters

CLIENT_KEY = "seamlessflow"  # the trainer's client state in a DeepSpeed checkpoint (services/trainer/engine.py)
EXPORT_INFO = "sf_export.json"  # beside the weights: {"tag", "step", "version"}


def _checkpoint_states(root: Path) -> tuple[str, dict, dict]:
    """(tag, module state dict, client state) of the newest checkpoint under `root`."""
    import torch

    try:
        tag = (root / "latest").read_text().strip()
    except OSError as e:
        raise SystemExit(f"{root}: no trainer checkpoint ('latest' missing): {e}") from None
    states = root / tag / "mp_rank_00_model_states.pt"  # ZeRO 0-2 (with node-local dirs: on each node)
    if not states.is_file():
        raise SystemExit(f"{root / tag}: no mp_rank_00_model_states.pt (not a trainer checkpoint, or not this node's)")
    saved = torch.load(states, map_location="cpu", weights_only=False)
    module = saved.get("module") or {}
    if not module:  # ZeRO-3 writes the parameters as per-rank shards
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        module = get_fp32_state_dict_from_zero_checkpoint(str(root), tag=tag)
    return tag, module, saved.get(CLIENT_KEY) or {}


def export_checkpoint(src: Path, out: Path, base: Path) -> str:
    """A full fine-tune's newest checkpoint under `src` as an HF checkpoint at `out`, tensor for
    tensor in `base`'s files (written beside `out`, renamed into place)."""
    from safetensors.torch import load_file, save_file

    src, out, base = Path(src), Path(out), Path(base)
    files = sorted(base.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"--checkpoint needs the base checkpoint (--model) for its config and layout: "
                         f"{base} has no *.safetensors")
    tag, module, client = _checkpoint_states(src)
    if any(".lora_A." in k for k in module):
        raise SystemExit(f"{src / tag}: a LoRA checkpoint; use --adapter or --merge")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in files:
        tensors = load_file(str(f))
        for name, t in tensors.items():
            if name not in module:
                shutil.rmtree(tmp, ignore_errors=True)
                raise SystemExit(f"{src / tag}: no tensor {name} (is {base} this checkpoint's base?)")
            new = module[name]
            if tuple(new.shape) != tuple(t.shape):
                shutil.rmtree(tmp, ignore_errors=True)
                raise SystemExit(f"{src / tag}: {name} has shape {tuple(new.shape)}, the base {tuple(t.shape)}")
            tensors[name] = new.detach().to(t.dtype).contiguous()
        save_file(tensors, str(tmp / f.name), metadata={"format": "pt"})
    adapters.copy_side_files(base, tmp)
    info = {"tag": tag, "step": int(client.get("step", 0)), "version": int(client.get("version", 0))}
    (tmp / EXPORT_INFO).write_text(json.dumps(info))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return f"wrote the HF checkpoint {out} from {src / tag} (step {info['step']}, version {info['version']})"


def _adapter_dir(src: Path, scratch: Path, role: str = "") -> Path:
    if adapters.is_adapter(src):
        adapters.check_adapter(src)
        return src
    if roles := adapters.role_adapters(src):  # a multi-LoRA version: one adapter dir per role
        if role not in roles:
            raise SystemExit(f"{src} holds one adapter per role: pass --role, one of {', '.join(roles)}")
        adapters.check_adapter(roles[role])
        return roles[role]
    return adapters.adapter_from_checkpoint(src, scratch / "adapter", role=role)


def export_weights(src: Path, out: Path, merge: bool, base: Path | None = None, role: str = "") -> str:
    with tempfile.TemporaryDirectory(prefix="sf-export-") as scratch:
        adapter = _adapter_dir(Path(src), Path(scratch), role)
        if merge:
            config = json.loads((adapter / adapters.ADAPTER_CONFIG).read_text())
            base = base or Path(config.get("base_model_name_or_path") or "")
            if not base or not (base / "config.json").is_file():
                raise SystemExit(f"--merge needs the base checkpoint: {base or 'none named'}; pass --model")
            adapters.merge_into_base(base, adapter, out)
            return f"wrote the merged checkpoint {out} ({base} + {src})"
        if Path(out).resolve() != adapter.resolve():
            shutil.rmtree(out, ignore_errors=True)
            Path(out).mkdir(parents=True)
            for name in (adapters.ADAPTER_CONFIG, adapters.ADAPTER_WEIGHTS):
                shutil.copy2(adapter / name, Path(out) / name)
        size = sum(f.stat().st_size for f in Path(out).iterdir())
        return f"wrote the adapter {out} ({size / 1e6:.2f} MB)"
