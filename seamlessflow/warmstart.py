"""A short supervised warm start on the built-in task, so RL starts from a policy that
sometimes succeeds (pure RL from random init rises very slowly: see ENV-NOTES).

    seamlessflow warm-start var/model var/model-sft

Plain torch, a few seconds on a laptop CPU: teacher-forced cross-entropy on the answer
tokens of chat-formatted "reverse DIGITS" prompts, stopped as soon as the *sampled*
(temperature 1) mean reward reaches `target_reward`, so RL still has room to improve.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import torch

from seamlessflow.tasks import reverse_prompt, reverse_reward


def _prompt_ids(tok, task: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": task}], add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


@torch.no_grad()
def sampled_reward(model, tok, rng: random.Random, n: int = 64, max_new: int = 8) -> float:
    tasks = [reverse_prompt(rng) for _ in range(n)]
    prompts = [_prompt_ids(tok, task) for task, _ in tasks]
    width = max(map(len, prompts))  # left-padded batch
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, attention_mask=attn, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                         max_new_tokens=max_new, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    answers = tok.batch_decode(out[:, width:], skip_special_tokens=True)
    return sum(reverse_reward(a, target) for a, (_, target) in zip(answers, tasks)) / n


def warm_start(src: Path, out: Path, target_reward: float = 0.3, max_steps: int = 400, batch: int = 32,
               lr: float = 1e-3, seed: int = 0, log=print) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    eval_rng = random.Random(seed + 1)
    reward = sampled_reward(model.eval(), tok, eval_rng)
    log(f"warm start: step 0 sampled reward {reward:.3f}")
    step = 0
    while reward < target_reward and step < max_steps:
        model.train()
        for _ in range(25):
            seqs, masks = [], []
            for _ in range(batch):
                task, target = reverse_prompt(rng)
                p = _prompt_ids(tok, task)
                a = tok.encode(target, add_special_tokens=False) + [tok.eos_token_id]
                seqs.append(p + a)
                masks.append([0] * len(p) + [1] * len(a))
            width = max(map(len, seqs))
            ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
            mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float32)
            attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
            nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                    reduction="none").view(ids.shape[0], -1)
            loss = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
        reward = sampled_reward(model.eval(), tok, eval_rng)
        log(f"warm start: step {step} loss {loss.item():.3f} sampled reward {reward:.3f}")
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    for extra in ("generation_config.json",):
        if (Path(src) / extra).exists():
            shutil.copy(Path(src) / extra, tmp / extra)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return {"steps": step, "sampled_reward": reward}
