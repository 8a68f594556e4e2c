"""`seamlessflow export --checkpoint`: a full fine-tune's newest trainer checkpoint as a plain HF
checkpoint (seamlessflow/ops/export_weights.export_checkpoint). The checkpoint is laid out as
DeepSpeed writes one at ZeRO 0-2 (`latest`, `<tag>/mp_rank_00_model_states.pt` with the module's
state dict and the trainer's client state); only that file is faked, the export and the HF load
are real."""

from __future__ import annotations

import json

import pytest
import torch

from seamlessflow.cli import main
from seamlessflow.ops.export_weights import CLIENT_KEY, EXPORT_INFO, export_checkpoint


def fake_checkpoint(root, model, tag: str, step: int, version: int) -> None:
    (root / tag).mkdir(parents=True)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save({"module": state, CLIENT_KEY: {"step": step, "version": version}},
               root / tag / "mp_rank_00_model_states.pt")
    (root / "latest").write_text(tag)


def test_newest_checkpoint_becomes_an_hf_checkpoint_with_its_version(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    fake_checkpoint(tmp_path / "ckpt", model, "step-00000003", 3, 2)  # an older one, then the newest
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    fake_checkpoint(tmp_path / "ckpt", model, "step-00000004", 4, 3)

    main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--model", str(tiny_model), "--out", str(tmp_path / "hf")])

    assert json.loads((tmp_path / "hf" / EXPORT_INFO).read_text()) == {"tag": "step-00000004", "step": 4, "version": 3}
    assert (tmp_path / "hf" / "tokenizer.json").exists() or (tmp_path / "hf" / "tokenizer_config.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    trained, got, was = model.state_dict(), loaded.state_dict(), base.state_dict()
    assert set(got) == set(trained)
    for name in got:
        assert torch.equal(got[name], trained[name]), name
    assert any(not torch.equal(got[n], was[n]) for n in got)  # the trained weights, not the base's


def test_refusals_name_the_cause(tiny_model, tmp_path):
    with pytest.raises(SystemExit, match="'latest' missing"):
        export_checkpoint(tmp_path / "none", tmp_path / "out", tiny_model)
    with pytest.raises(SystemExit, match="needs --model"):
        main(["export", "--checkpoint", str(tmp_path / "none"), "--out", str(tmp_path / "out")])
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    fake_checkpoint(tmp_path / "lora", model, "step-00000001", 1, 1)
    states = tmp_path / "lora" / "step-00000001" / "mp_rank_00_model_states.pt"
    saved = torch.load(states, weights_only=False)
    saved["module"]["model.layers.0.self_attn.q_proj.lora_A.default.weight"] = torch.zeros(2, 2)
    torch.save(saved, states)
    with pytest.raises(SystemExit, match="a LoRA checkpoint"):
        export_checkpoint(tmp_path / "lora", tmp_path / "out", tiny_model)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()
