"""services/trainer/engine.py with LoRA (services/trainer/lora.py) on real DeepSpeed (CPU, gloo).

The reference is written out by hand: PEFT around the HF model, torch AdamW over the
adapter's parameters, the KL reference taken from an untouched HF copy of the base.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.test_trainer_engine import STEPS, assert_close, step_batches

pytestmark = [
    pytest.mark.deepspeed,
    pytest.mark.filterwarnings("ignore:.*is deprecated.*:FutureWarning"),
]


def lora_cfg(TrainerConfig, model: Path, **kw):
    base = dict(model_dir=str(model), lr=1e-2, micro_batch_tokens=32, lora_rank=4, lora_alpha=8.0,
                grad_clip=1.0, kl_coef=0.1)
    return TrainerConfig(**{**base, **kw})


def peft_reference(m, cfg, steps_batches):
    """PEFT + torch AdamW on the adapter only; KL against a separate plain copy of the base."""
    _, _, _, policy_loss, _ = m
    from transformers import AutoModelForCausalLM

    from services.trainer import lora

    def logp(model, mb):
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits.float()
        return torch.log_softmax(logits, -1).gather(-1, mb.targets.unsqueeze(-1)).squeeze(-1)

    torch.manual_seed(cfg.seed)
    model = lora.wrap(AutoModelForCausalLM.from_pretrained(cfg.model_dir, dtype=torch.float32), lora.lora_spec(cfg))
    base = AutoModelForCausalLM.from_pretrained(cfg.model_dir, dtype=torch.float32).requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps)
    for mbs in steps_batches:
        n_tok, n_seq = sum(mb.num_tokens for mb in mbs), sum(mb.num_seqs for mb in mbs)
        with torch.no_grad():
            prox = [logp(model, mb) for mb in mbs]
            ref = [logp(base, mb) for mb in mbs]
        for mb, p, r in zip(mbs, prox, ref):
            loss, _ = policy_loss(logp(model, mb), p, mb.behav_logprobs, mb.advantages, mb.loss_mask, cfg.algo(),
                                  ref_logp=r, num_tokens=n_tok, num_seqs=n_seq)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, cfg.grad_clip)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_lora_step_trains_the_adapter_only_and_matches_peft(modules, tiny_model, stage):
    engine, *_, TrainerConfig = modules
    # lr 1e-3: Adam turns the last-bit differences between DeepSpeed's and torch's reductions
    # into lr-sized steps on the near-zero lora_A gradients of the first steps
    cfg = lora_cfg(TrainerConfig, tiny_model, zero_stage=stage, lr=1e-3)
    eng = engine.TrainEngine(cfg)
    assert eng.ref_model is None  # the KL reference is the adapter switched off, not a copy
    trainable = {n for n, p in eng.module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    in_optimizer = sum(len(g["params"]) for g in eng.engine.client_optimizer.param_groups) \
        if stage == 0 else None
    if in_optimizer is not None:
        assert in_optimizer == len(trainable)
    batches = step_batches(modules, cfg, eng.module.config.vocab_size, eng.pad_id)
    expected = peft_reference(modules, cfg, batches)
    for mbs in batches:
        metrics = eng.train_step(mbs)
    assert metrics["kl"] > 0  # the adapter moved the policy away from the base
    got = {n: t for n, t in _full_named(eng).items()}
    assert_close(got, expected, 1e-4, f"zero{stage} LoRA params after {STEPS} steps")
    base = {n: t for n, t in got.items() if n not in trainable}
    assert_close(base, {n: expected[n] for n in base}, 0.0, "frozen base")


def _full_named(eng) -> dict[str, torch.Tensor]:
    import deepspeed

    params = list(eng.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=eng.cfg.zero_stage == 3):
        return {n: p.detach().clone() for n, p in eng.module.named_parameters()}


def test_lora_checkpoint_holds_the_adapter_and_resumes(modules, tiny_model, tmp_path):
    engine, *_, TrainerConfig = modules
    cfg = lora_cfg(TrainerConfig, tiny_model, zero_stage=2, keep_checkpoints=2)
    eng = engine.TrainEngine(cfg)
    batches = step_batches(modules, cfg, eng.module.config.vocab_size, eng.pad_id)
    root = tmp_path / "ckpt"
    client = {"step": 1, "weight_version": 1}
    eng.train_step(batches[0])
    eng.save_checkpoint(root, client)
    eng.train_step(batches[1])
    eng.train_step(batches[2])
    expected = _full_named(eng)

    size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    model_bytes = sum(f.stat().st_size for f in Path(tiny_model).glob("*.safetensors"))
    assert size < model_bytes  # adapter + its Adam moments, not the base

    torch.manual_seed(123)  # a different fresh adapter init: the checkpoint must overwrite it
    fresh = engine.TrainEngine(lora_cfg(TrainerConfig, tiny_model, zero_stage=2, seed=7))
    assert fresh.load_checkpoint(root) == client
    assert fresh.global_steps == 1
    fresh.train_step(batches[1])
    fresh.train_step(batches[2])
    assert_close(_full_named(fresh), expected, 1e-6, "resumed vs uninterrupted")


@pytest.mark.parametrize("publish", ["adapter", "merged"])
def test_lora_publish_loads_with_peft_and_transformers(modules, tiny_model, tmp_path, publish):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from shared.checkpoint import check_checkpoint

    engine, *_, TrainerConfig = modules
    cfg = lora_cfg(TrainerConfig, tiny_model, zero_stage=3, lora_publish=publish, kl_coef=0.0)
    eng = engine.TrainEngine(cfg)
    batches = step_batches(modules, cfg, eng.module.config.vocab_size, eng.pad_id)
    eng.train_step(batches[0])
    out = eng.save_hf(tmp_path / "v1")
    check_checkpoint(out)
    mb = batches[1][0]
    want = eng.logprobs(mb)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    if publish == "adapter":
        assert {f.name for f in out.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
        model = PeftModel.from_pretrained(base, str(out))
    else:
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits.float()
    got = torch.log_softmax(logits, -1).gather(-1, mb.targets.unsqueeze(-1)).squeeze(-1)
    real = mb.attention_mask.bool()
    assert float((got - want)[real].abs().max()) < 1e-4
