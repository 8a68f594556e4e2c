"""bench/probe_learning.py's LoRA: the policy is the trainer's (services/trainer/lora.py via
TrainerConfig), only the adapter is optimised and moves, and the KL reference is the base.
(The probe's runs are not in the suite: they take minutes; tests/bench/test_smoke.py runs a short one.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.probe_learning import DEFAULTS, build_policy, reference, seq_logprobs, train_step  # noqa: E402
from services.trainer.algorithms import AlgoConfig  # noqa: E402
from services.trainer.batching import build_global_batch  # noqa: E402
from services.trainer.lora import TARGET_SETS  # noqa: E402
from shared.messages.trajectory import Sample, TrajectoryCompleted  # noqa: E402


def opts(model: Path, **kw) -> dict:
    return {**DEFAULTS, "model": str(model), "lr": 1e-2, "lr_warmup_steps": 0, **kw}


def lora_layers(model) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}


@pytest.mark.parametrize(("targets", "alpha", "scaling"), [("all", 0.0, 2.0), ("attn", 4.0, 0.5)])
def test_lora_policy_is_the_trainers(tiny_model, targets, alpha, scaling):
    model, opt, _sched, ref = build_policy(opts(tiny_model, lora_rank=8, lora_alpha=alpha, lora_targets=targets))
    layers = lora_layers(model)
    n_layers = model.config.num_hidden_layers
    assert sorted({n.rsplit(".", 1)[1] for n in layers}) == sorted(TARGET_SETS[targets])
    assert len(layers) == n_layers * len(TARGET_SETS[targets])
    for m in layers.values():
        assert m.r["default"] == 8 and m.scaling["default"] == scaling  # alpha 0 = 2 x rank, as lora_spec
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    assert len(trainable) == 2 * len(layers)
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    assert in_opt == {id(p) for p in model.parameters() if p.requires_grad}
    assert opt.param_groups[0]["lr"] == 1e-2 and ref is None  # kl_coef 0: no reference


def test_full_finetune_trains_every_parameter(tiny_model):
    model, opt, _sched, _ref = build_policy(opts(tiny_model))
    assert not lora_layers(model)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))


def groups_of(model, tok_len: int = 6) -> list[list[TrajectoryCompleted]]:
    """Two groups of two made-up answers with different rewards (so the advantages are not zero)."""
    torch.manual_seed(0)
    seqs = [torch.randint(3, model.config.vocab_size, (tok_len,)).tolist() for _ in range(4)]
    plen = 3
    behav = seq_logprobs(model, seqs, [plen] * 4, 0)
    out = []
    for g in range(2):
        grp = []
        for k in range(2):
            i = 2 * g + k
            s = Sample(seqs[i], [0] * plen + [1] * (tok_len - plen), behav[i], [-1] * plen + [0] * (tok_len - plen))
            grp.append(TrajectoryCompleted(f"s{i}", f"g{g}", float(k), [s]))
        out.append(grp)
    return out


def test_a_lora_step_moves_the_adapter_alone_and_the_reference_is_the_base(tiny_model):
    from transformers import AutoModelForCausalLM

    o = opts(tiny_model, lora_rank=8, kl_coef=0.1)
    model, opt, sched, ref = build_policy(o)
    assert ref is model  # no second copy: the base is the policy with its adapter off
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    algo = AlgoConfig(kl_coef=0.1)
    gb = build_global_batch(groups_of(model), algo)
    _parts, gn = train_step(model, (opt, sched), gb, algo, o, 0, ref)
    assert float(gn) > 0
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all(".lora_" in n for n in moved)
    assert any(".lora_B." in n for n in moved)  # B starts at zero: the adapter is no longer a no-op
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    model.eval()
    with torch.no_grad():
        with reference(model, ref) as r:
            ref_logits = r(input_ids=ids).logits
        policy_logits = model(input_ids=ids).logits
        base_logits = base(input_ids=ids).logits
    torch.testing.assert_close(ref_logits, base_logits)
    assert not torch.allclose(policy_logits, base_logits)
