"""`seamlessflow export --merge/--adapter` on versions and checkpoints a LoRA trainer wrote.

Must show: the merged export's outputs equal base + adapter (PEFT) within 1e-4 in fp32 on
every layer's output, for every target-module set offered; the adapter export loads in
peft as it is and holds the trained tensors.
"""

from __future__ import annotations

import pytest
import torch

from tests.integration.test_trainer_engine import step_batches

pytestmark = [
    pytest.mark.deepspeed,
    pytest.mark.filterwarnings("ignore:.*is deprecated.*:FutureWarning"),
]


def every_layer(model, ids: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    return [*out.hidden_states, out.logits]


# (target set, ZeRO stage of the trainer that wrote it): every set, and every way the tensors are stored
CASES = [("attn", 0), ("mlp", 2), ("all", 3)]


@pytest.mark.parametrize(("targets", "stage"), CASES)
def test_merged_export_equals_base_plus_adapter_on_every_layer(modules, tiny_model, tmp_path, targets, stage):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from seamlessflow.cli import main
    from services.trainer.lora import TARGET_SETS

    engine, *_, TrainerConfig = modules
    cfg = TrainerConfig(model_dir=str(tiny_model), zero_stage=stage, lr=5e-2, micro_batch_tokens=64,
                        lora_rank=8, lora_targets=targets)
    eng = engine.TrainEngine(cfg)
    for mbs in step_batches(modules, cfg, eng.module.config.vocab_size, eng.pad_id)[:2]:
        eng.train_step(mbs)
    version = eng.save_hf(tmp_path / "v000002")
    eng.save_checkpoint(tmp_path / "ckpt", {"step": 2})

    # --adapter from the checkpoint: a PEFT dir with the published version's tensors
    main(["export", "--adapter", str(tmp_path / "ckpt"), "--out", str(tmp_path / "exported")])
    published, exported = (load_file(str(d / "adapter_model.safetensors")) for d in (version, tmp_path / "exported"))
    assert published.keys() == exported.keys()
    assert {k.split(".")[-3] for k in published} == set(TARGET_SETS[targets])
    for k in published:
        assert torch.equal(published[k], exported[k]), k
    assert max(float(t.abs().max()) for k, t in published.items() if ".lora_B." in k) > 1e-2  # trained

    # --merge from the version: a plain HF checkpoint equal to base + adapter on every layer
    main(["export", "--merge", str(version), "--out", str(tmp_path / "merged")])
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
                                           str(tmp_path / "exported")).eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    ids = torch.randint(3, peft_model.config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(0))
    want, got, before = every_layer(peft_model, ids), every_layer(merged, ids), every_layer(base, ids)
    assert len(got) == merged.config.num_hidden_layers + 2
    for i, (w, g) in enumerate(zip(want, got)):
        assert float((w - g).abs().max()) <= 1e-4, f"{targets}: output {i} differs"
    assert float((want[-1] - before[-1]).abs().max()) > 1e-2  # the adapter changes the model


def test_export_refuses_a_full_checkpoint(tmp_path, tiny_model):
    from seamlessflow.ops.export_weights import export_weights
    from shared.checkpoint import CheckpointError

    (tmp_path / "ckpt" / "step-1").mkdir(parents=True)
    (tmp_path / "ckpt" / "latest").write_text("step-1")
    with pytest.raises(CheckpointError, match="not a LoRA checkpoint"):
        export_weights(tmp_path / "ckpt", tmp_path / "out", merge=False)
