"""`seamlessflow export --merge SRC` / `--adapter SRC`: a LoRA version out of the system.

    seamlessflow export --adapter var/weights/v000012 --out my-adapter     # PEFT adapter dir
    seamlessflow export --adapter var/trainer/checkpoints --out my-adapter # newest checkpoint's
    seamlessflow export --merge var/weights/v000012 --out merged-model     # base + adapter, plain HF
    seamlessflow export --adapter var/weights/v000012 --role solver --out solver-adapter  # multi-LoRA

SRC is an adapter version (what a LoRA trainer publishes into the weight store) or a LoRA
trainer's checkpoint dir (its `latest` tag). `--merge` folds the adapter into the base
checkpoint named by `--model`, else by the adapter's `base_model_name_or_path`.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from shared import adapters


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
