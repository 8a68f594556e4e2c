"""services/trainer/engine.py on real DeepSpeed (CPU, gloo) against a plain-PyTorch reference.

The reference step below is written out by hand: HF model, its own logprob
gather, loss.backward() per micro-batch, torch clip_grad_norm_, torch AdamW.
Only the loss formula is shared (it has its own independent test in
tests/unit/test_trainer_algorithms.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.deepspeed,
    pytest.mark.filterwarnings("ignore:.*is deprecated.*:FutureWarning"),  # DeepSpeed's own collectives
]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


def step_batches(m, cfg, vocab: int, pad_id: int):
    _, batching, dp_check, _, _ = m
    out = []
    for step in range(STEPS):
        gb = batching.build_global_batch(dp_check.synthetic_groups(step, vocab=vocab), cfg.algo())
        out.append(batching.micro_batches(gb.rows, cfg.micro_batch_tokens, pad_id))
    return out


def reference_training(m, cfg, steps_batches):
    """Plain PyTorch: per optimizer step, the grads before clipping and the params after the update."""
    _, _, _, policy_loss, _ = m
    from transformers import AutoModelForCausalLM

    def logprobs_and_entropy(model, mb):
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits.float()
        logsm = torch.log_softmax(logits, dim=-1)
        return logsm.gather(-1, mb.targets.unsqueeze(-1)).squeeze(-1), -(logsm.exp() * logsm).sum(-1)

    model = AutoModelForCausalLM.from_pretrained(cfg.model_dir, dtype=torch.float32)
    ref_model = AutoModelForCausalLM.from_pretrained(cfg.model_dir, dtype=torch.float32).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps,
                            weight_decay=cfg.weight_decay)
    algo = cfg.algo()
    grads, params, norms = [], [], []
    for mbs in steps_batches:
        n_tok = sum(mb.num_tokens for mb in mbs)
        n_seq = sum(mb.num_seqs for mb in mbs)
        with torch.no_grad():  # proximal policy: the weights before this global batch's first update
            prox = [logprobs_and_entropy(model, mb)[0] for mb in mbs]
            ref = [logprobs_and_entropy(ref_model, mb)[0] for mb in mbs]
        for _epoch in range(cfg.ppo_epochs):
            for mb, p, r in zip(mbs, prox, ref):
                logp, entropy = logprobs_and_entropy(model, mb)
                loss, _ = policy_loss(logp, p, mb.behav_logprobs, mb.advantages, mb.loss_mask, algo,
                                      ref_logp=r, entropy=entropy, num_tokens=n_tok, num_seqs=n_seq)
                loss.backward()
            grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)))
            opt.step()
            opt.zero_grad()
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return grads, params, norms


def capture_grads(eng):
    """Record each optimizer step's full gradients, read just before DeepSpeed applies them."""
    from deepspeed.utils import safe_get_full_grad

    ds = eng.engine
    seen: list[dict[str, torch.Tensor]] = []
    original = ds.step

    def step(*args, **kwargs):
        if ds.is_gradient_accumulation_boundary():
            seen.append({n: safe_get_full_grad(p).detach().clone() for n, p in ds.module.named_parameters()})
        return original(*args, **kwargs)

    ds.step = step
    return seen


def assert_close(a: dict, b: dict, atol: float, what: str):
    assert a.keys() == b.keys()
    worst = max((float((a[k] - b[k]).abs().max()), k) for k in a)
    assert worst[0] <= atol, f"{what}: max |diff| {worst[0]:.3g} at {worst[1]}"


LOSS_VARIANTS = {
    "zero0": (0, {}),
    "zero2": (2, {}),
    # a second PPO epoch (ratio != 1), KL to the reference, entropy bonus, seq-mean
    "zero2-kl-entropy-2epochs-seqmean": (2, dict(kl_coef=0.1, entropy_coef=0.01, ppo_epochs=2,
                                                 aggregation="seq-mean")),
}


@pytest.mark.parametrize("variant", list(LOSS_VARIANTS))
def test_deepspeed_step_matches_plain_pytorch(modules, tiny_model, variant, record_property):
    engine, _, _, _, TrainerConfig = modules
    stage, extra = LOSS_VARIANTS[variant]
    # grad_clip below the gradient norm, so clipping is part of what must match
    cfg = TrainerConfig(model_dir=str(tiny_model), zero_stage=stage, lr=1e-3, weight_decay=0.01, grad_clip=0.2,
                        micro_batch_tokens=32, **extra)
    t0 = time.perf_counter()
    eng = engine.TrainEngine(cfg)
    record_property("deepspeed_init_s", round(time.perf_counter() - t0, 3))
    batches = step_batches(modules, cfg, eng.module.config.vocab_size, eng.pad_id)
    assert all(len(mbs) > 1 for mbs in batches)  # gradient accumulation is exercised
    ref_grads, ref_params, ref_norms = reference_training(modules, cfg, batches)
    assert min(ref_norms) > cfg.grad_clip

    seen = capture_grads(eng)
    step_s = []
    for mbs in batches:
        t0 = time.perf_counter()
        metrics = eng.train_step(mbs)
        step_s.append(time.perf_counter() - t0)
    record_property("step_s", [round(s, 4) for s in step_s])
    assert len(seen) == STEPS * cfg.ppo_epochs
    for i in range(len(seen)):
        assert_close(seen[i], ref_grads[i], 1e-4, f"{variant} grads, optimizer step {i}")
    params = {n: p.detach() for n, p in eng.module.named_parameters()}
    assert_close(params, ref_params[-1], 1e-4, f"{variant} params after {STEPS} steps")
    moved = max(float((ref_params[-1][n] - ref_params[0][n]).abs().max()) for n in params)
    assert moved > 1e-3  # the comparison is not between two untrained models
    assert metrics["tokens"] == sum(mb.num_tokens for mb in batches[-1])
    if cfg.ppo_epochs > 1:
        assert metrics["clip_frac"] > 0 and metrics["kl"] > 0
    for key in ("loss", "clip_frac", "is_weight_mean", "is_weight_max", "entropy", "compute_s"):
        assert key in metrics


@pytest.mark.parametrize("stage", [0, 3])
def test_save_hf_loads_back_with_transformers(modules, tiny_model, tmp_path, stage):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    engine, _, _, _, TrainerConfig = modules
    cfg = TrainerConfig(model_dir=str(tiny_model), zero_stage=stage, lr=1e-2, micro_batch_tokens=64)
    eng = engine.TrainEngine(cfg)
    eng.train_step(step_batches(modules, cfg, eng.module.config.vocab_size, eng.pad_id)[0])
    trained = eng.full_state_dict()

    out = eng.save_hf(tmp_path / "v1")
    assert not (tmp_path / "v1.tmp").exists()
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    original = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).state_dict()
    assert_close({k: loaded[k] for k in trained}, trained, 0.0, "saved vs trained")
    assert max(float((loaded[k] - original[k]).abs().max()) for k in trained) > 1e-3
    assert AutoTokenizer.from_pretrained(out).chat_template  # vLLM needs the tokenizer beside the weights


def test_checkpoint_resumes_model_optimizer_and_client_state(modules, tiny_model, tmp_path):
    engine, _, _, _, TrainerConfig = modules
    cfg = TrainerConfig(model_dir=str(tiny_model), zero_stage=2, lr=1e-3, micro_batch_tokens=64,
                        keep_checkpoints=2)
    eng = engine.TrainEngine(cfg)
    batches = step_batches(modules, cfg, eng.module.config.vocab_size, eng.pad_id)
    root = tmp_path / "ckpt"
    client = {"step": 1, "weight_version": 1, "consumed": ["s0-0-0", "s0-0-1"]}
    eng.train_step(batches[0])
    eng.save_checkpoint(root, client)
    eng.train_step(batches[1])
    eng.train_step(batches[2])
    expected = eng.full_state_dict()

    fresh = engine.TrainEngine(cfg)
    assert fresh.load_checkpoint(tmp_path / "nothing-here") is None
    assert fresh.load_checkpoint(root) == client
    assert fresh.global_steps == 1
    fresh.train_step(batches[1])  # Adam moments restored: the same two steps land on the same weights
    fresh.train_step(batches[2])
    assert_close(fresh.full_state_dict(), expected, 1e-6, "resumed vs uninterrupted")

    fresh.save_checkpoint(root, {**client, "step": 3})
    fresh.train_step(batches[0])
    fresh.save_checkpoint(root, {**client, "step": 4})
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step-00000003", "step-00000004"]
    assert engine.TrainEngine(cfg).load_checkpoint(root)["step"] == 4


def test_two_ranks_data_parallel_end_identical(modules, tiny_model, tmp_path, record_property):
    """torchrun, 2 gloo ranks on different shards: identical params, equal to one rank on the whole batch."""
    _, _, dp_check, _, TrainerConfig = modules
    out = tmp_path / "dp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "services.trainer.dp_check", "--model", str(tiny_model), "--out", str(out),
           "--stages", "0,2", "--steps", str(STEPS), "--micro-batch-tokens", "32"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=240)
    record_property("two_rank_run_s", round(time.perf_counter() - t0, 1))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    logs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    # uneven micro-batch counts were kept in step
    assert logs[0]["zero0"]["micro_batches"] != logs[1]["zero0"]["micro_batches"]

    for stage in (0, 2):
        ranks = [torch.load(out / f"rank{r}-zero{stage}.pt") for r in range(2)]
        assert_close(ranks[0], ranks[1], 0.0, f"zero-{stage} rank 0 vs rank 1")
        cfg = TrainerConfig(model_dir=str(tiny_model), zero_stage=stage, lr=1e-3, grad_clip=1.0,
                            micro_batch_tokens=32)
        single, log, _ = dp_check.train(cfg, STEPS)
        # summation order differs between one and two ranks: float32 noise grows with model size
        assert_close(ranks[0], single, 1e-4, f"zero-{stage} two ranks vs one rank on the whole batch")
        # Adam hides a uniformly scaled gradient; the global loss and grad norm do not.
        for r in range(2):
            assert logs[r][f"zero{stage}"]["loss"] == pytest.approx(log["loss"], abs=1e-6)
            if stage:
                assert logs[r][f"zero{stage}"]["grad_norm"] == pytest.approx(log["grad_norm"], rel=1e-5)
