"""The warm start's stopping rule (seamlessflow/demo/warmstart.py), with the sampled check replaced:
coarse checks every CHECK_EVERY steps, then, past half the target, a quarter of the lr and a
larger check after every step, stopping at the first check at or above the target. The
supervised steps are real (the tiny model), so the saved model is a loadable checkpoint."""

from __future__ import annotations

import pytest

from seamlessflow.demo import warmstart
from seamlessflow.demo.warmstart import WarmStart


@pytest.fixture
def checks(monkeypatch):
    """Replace the sampled check: it returns the next scripted reward and records its sample count."""
    seen: list[int] = []
    script: list[float] = []

    def fake(model, tok, rng, n=64, max_new=8, task="reverse"):
        seen.append(n)
        return script.pop(0)

    monkeypatch.setattr(warmstart, "sampled_reward", fake)
    return script, seen


def test_past_half_the_target_it_checks_every_step_with_more_samples_and_stops_at_the_target(
        tiny_model, tmp_path, checks):
    script, seen = checks
    script += [0.0, 0.1, 0.3, 0.45, 0.52]  # step 0, 5, 10 (past 0.25), 11, 12 (>= 0.5)
    lines: list[str] = []
    out = warmstart.warm_start(tiny_model, tmp_path / "sft", WarmStart(target_reward=0.5, max_steps=100, batch=4),
                               log=lines.append)
    assert out == {"steps": 12, "sampled_reward": 0.52}
    assert seen == [64, 64, 64, 128, 128]
    assert any("past half the target: lr 0.00025" in line for line in lines), lines
    assert (tmp_path / "sft" / "config.json").exists() and not (tmp_path / "sft.tmp").exists()


def test_without_fine_checks_it_keeps_the_coarse_rule(tiny_model, tmp_path, checks):
    """The learning test's settings (fine=False): every `check_every` steps, one lr, 64 samples."""
    script, seen = checks
    script += [0.0, 0.2, 0.31]
    out = warmstart.warm_start(tiny_model, tmp_path / "sft", WarmStart(target_reward=0.3, check_every=3, fine=False,
                                                                       batch=4), log=lambda line: None)
    assert out["steps"] == 6 and seen == [64, 64, 64]


def test_a_warm_start_that_hits_its_step_bound_says_so(tiny_model, tmp_path, checks):
    script, seen = checks
    script += [0.0, 0.01, 0.02]
    lines: list[str] = []
    out = warmstart.warm_start(tiny_model, tmp_path / "sft", WarmStart(max_steps=10, check_every=5, batch=4),
                               log=lines.append)
    assert out == {"steps": 10, "sampled_reward": 0.02}
    assert any("WARNING stopped at its 10-step bound" in line and "below the target 0.5" in line for line in lines)
    assert warmstart.MAX_STEPS["calc"] > warmstart.MAX_STEPS["reverse"]  # calc's copies are learned late

@pytest.mark.parametrize("task", ["calc", "reverse", "one prompt"])
def test_the_shared_prefix_gives_the_loss_and_gradients_of_running_every_row_in_full(tiny_model, task):
    """calc's examples share a ~200-token system prompt: it is run once and its keys and values
    repeated across the batch. The loss and every gradient must match the plain batch."""
    import random

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rng = random.Random(3)
    if task == "one prompt":  # the whole prompt is shared: its last position predicts each first answer token
        prompt = warmstart._prompt_ids(tok, "reverse 123")
        answers = [warmstart._enc(tok, a) + [tok.eos_token_id] for a in ("321", "12", "9", "3210")]
        seqs = tuple(prompt + a for a in answers)
        masks = tuple([0] * len(prompt) + [1] * len(a) for a in answers)
        assert warmstart._common_prefix(seqs) == len(prompt)
    else:
        seqs, masks = zip(*(warmstart.sft_example(tok, task, rng) for _ in range(6)))
        # calc: the tool schema is shared; reverse: "<|im_start|>user\nreverse ", too short to bother
        assert (warmstart._common_prefix(seqs) > 150) == (task == "calc")

    def loss_and_grads(min_shared):
        model.zero_grad()
        loss = warmstart.sft_loss(model, tok.pad_token_id, seqs, masks, min_shared=min_shared)
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters()]

    full_loss, full_grads = loss_and_grads(10**9)
    loss, grads = loss_and_grads(1)
    assert loss == pytest.approx(full_loss, rel=1e-5)
    for got, want in zip(grads, full_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_a_pretrained_models_sft_takes_its_fixed_steps_and_saves_a_checkpoint(tiny_model, tmp_path):
    """calc_sft (demo --model smollm2, the probe's --sft-steps): `steps` real supervised steps with the
    loss falling, a stop asked for after a step ends it there, and sft_checkpoint saves a loadable model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from seamlessflow.demo.tasks import CalcLevel
    from seamlessflow.demo.warmstart import CalcSFT

    o = CalcSFT(steps=3, batch=4, lr=1e-3, level=CalcLevel(5))
    lines: list[str] = []
    res = warmstart.sft_checkpoint(tiny_model, tmp_path / "sft", o, log=lines.append)
    assert res["steps"] == 3 and len(res["loss"]) == 3 and res["loss"][-1] < res["loss"][0]
    assert [line.split()[:3] for line in lines] == [["sft", "step", str(k)] for k in (1, 2, 3)]
    AutoModelForCausalLM.from_pretrained(tmp_path / "sft")
    assert not (tmp_path / "sft.tmp").exists()
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    stopped = warmstart.calc_sft(model, tok, o, log=lambda m: None, after_step=lambda step: step == 2)
    assert stopped["steps"] == 2
