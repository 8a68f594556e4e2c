"""Offline probe: does the trainer's loss raise the reward of the built-in "reverse" task?

A single-process simulation of the real RL loop in plain torch + HF transformers: no
NATS, no vLLM, no DeepSpeed. Per step it samples `groups` prompts x `group_size`
answers from the current policy (temperature 1, top_k 0, top_p 1, at most 8 new
tokens, EOS kept in the answer and in the loss like the real system), scores them
with seamlessflow/demo/tasks.py, builds the global batch with the trainer's own code
(services/trainer/batching.py: build_global_batch -> micro_batches, i.e. the real
advantages, shift and loss mask) and runs the same update as
services/trainer/engine.py TrainEngine.train_step: per PPO epoch, gradient
accumulation over micro-batches of `policy_loss(...)` with the global token/sequence
normalisers, the proximal logprobs taken from epoch 0's forward, grad-norm clipping,
one AdamW step (betas/eps/weight decay from the flags) and a LambdaLR linear warm-up
stepped after each optimizer step. Rollout is on-policy (staleness 0, behaviour
logprobs = the sampling model's forward), so the TIS weight is exactly 1, unless
`--staleness K`: then step t samples from a copy of the policy after step max(0, t - K)
(behaviour logprobs and token versions are that copy's) and trains the current policy on it,
as the demo's trainer does with tokens K versions old (the TIS weight then is
min(pi_now / pi_behaviour, tis_cap)). Full fine-tune only.

Every `--eval-every` steps it evaluates on a fixed set of prompts (same prompts and,
via a fixed torch seed, the same sampling noise in every run): sampled reward at
temperature 1 and greedy reward.

Run (from the repo root, one core):

    # 1. build the tiny model and warm starts (same code and seeds as tests/conftest.py):
    .venv/bin/python bench/probe_learning.py prepare --dir /tmp/probe --targets 0.3 0.4
    # 2. one run (prints a line per step and a JSON summary):
    .venv/bin/python bench/probe_learning.py run --model /tmp/probe/warm0.3 --lr 3e-4 --warmup 5
    # 3. a sweep: a JSON list of option dicts (keys = run flags with _ for -), one JSON line each:
    .venv/bin/python bench/probe_learning.py sweep grid.json --out results.jsonl

Costs (one core): tiny model ~0.1 s/step at 32 samples, ~0.15 s at 64; a 60-step run with
7 evals of 256 prompts takes ~15-40 s. "small" model ~0.35 s/step.

What it found (tiny model, warm start target 0.3 = 75 SFT steps, eval 256 prompts):
sampled 0.36 / greedy 0.63 at the start; lr 1e-4 (no warm-up needed) is the best and
gives only about +0.10 in 60 steps (0.36 -> 0.45-0.47, 32 or 64 samples per step, 2 seeds);
lr >= 3e-4 loses greedy reward and lr 1e-3 collapses (answers truncated by an early EOS)
because the small-batch gradient is mostly noise (a 512-sample batch at lr 1e-3 does
not collapse). The "small" model from the same warm start gains +0.25 in 60 steps at lr 1e-4.

Flags of `run` mirror TrainerConfig (lr, lr_warmup_steps, beta1, beta2, adam_eps,
weight_decay, grad_clip, ppo_epochs, group_size, groups_per_step, advantage,
std_normalize, aggregation, entropy_coef, clip_low, clip_high, ...).

calc (`--task calc`, issue 26: a real chat model, e.g. SmolLM2 from `seamlessflow init-model --from
smollm2`): the demo's two-turn calculator session (seamlessflow/demo/rl.py calc_agent) through the
model's own chat template with the tool; a parsed tool call runs tasks.calculator_call and the
template's tool turn is appended untrained; both turns are one Sample. The ~200-token system prompt is
run once per batch (sample_shared, shared_prefix_logp: the same logprobs as the full forward). Knobs:
--max-new (tokens a turn, 40 = the demo's), --calc-max-operand/--calc-ops/--calc-hint
(tasks.CalcLevel), --calc-reward lenient; evals report exact, lenient and tool-call rates, --dump
writes their sessions. --sft-steps N first fine-tunes on the task's own conversations (warmstart.sft_example:
the call in the model's template, the tool's result, the bare answer; see DEFAULTS), a start RL can see:
4 steps at lr 5e-5 already take SmolLM2 to exact 0.95 (T = 1), so keep it to 1-2 steps or a lower lr
(4 at 2e-5 gave 0.13). --time-budget-s S: RL runs for as many steps as fit in S seconds of wall (the
issue's "within 30 minutes"), then evaluates where it stopped.
~15 s a step at 2 x 8 on SmolLM2, one core (docs/history/benchmarks-log.md,
"SmolLM2-135M on calc"):

    .venv/bin/python bench/probe_learning.py run --model DIR --task calc --max-new 40 --steps 20 \
        --groups-per-step 2 --group-size 8 --lr 1e-5 --lr-warmup-steps 2 --drop-uniform-groups true \
        --micro-batch-tokens 16384 --calc-max-operand 9 --calc-ops +- \
        --calc-hint "Answer with the number only." --calc-reward lenient --eval-every 20 --eval-n 128

LoRA: `--lora-rank R [--lora-alpha A --lora-targets all]` builds the policy the way the
trainer does (`build_policy`: a TrainerConfig -> services/trainer/lora.py lora_spec + wrap,
the same PEFT wrapping, target sets and alpha default of 2 x rank; optim.adamw over the adapter's
parameters alone; the KL reference is the policy with its adapter disabled). Issue 27's side by
side (docs/history/benchmarks-log.md, "LoRA against full fine-tune"):

    .venv/bin/python bench/probe_learning.py run --model WARM --group-size 16 --groups-per-step 8 \
        --lr 2e-4 --lora-rank 8 --lora-targets all --seed 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from seamlessflow.demo.tasks import CALC_CORRECT, CALCULATOR_TOOL, REVERSE_SHAPINGS, CalcLevel, answer_reward, calc_prompt, \
    calc_reward, calculator_call, reverse_prompt, reverse_reward
from seamlessflow.demo.warmstart import _prompt_ids
from services.trainer import lora, optim
from services.trainer.algorithms import AlgoConfig, merge_metrics, policy_loss
from services.trainer.batching import build_global_batch, micro_batches
from services.trainer.config import TrainerConfig
from shared.messages.trajectory import Sample, TrajectoryCompleted
from shared.toolcalls import parse as parse_tool_calls

MAX_NEW = 8  # reverse's answer tokens a turn
# calc (`--task calc`): tokens a turn. SmolLM2's Hermes tool call is ~30 tokens; its answers are prose
# ("The answer is 1776.") unless RL teaches it to answer with the number alone.
CALC_MAX_NEW = 64


def token_logprobs(logits, targets, with_entropy):
    """Copy of services/trainer/engine.py token_logprobs (that module imports DeepSpeed)."""
    logsm = logits.float().log_softmax(-1)
    logp = logsm.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logsm.exp() * logsm).sum(-1) if with_entropy else None
    return logp, entropy


def left_pad(prompts, pad_id):
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, attn, width


@torch.no_grad()
def generate(model, tok, prompts, do_sample=True, max_new=MAX_NEW):
    """Answer token lists (cut after the first EOS, EOS included), batched and left-padded."""
    ids, attn, width = left_pad(prompts, tok.pad_token_id)
    kw = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if do_sample else {"do_sample": False}
    out = model.generate(ids, attention_mask=attn, max_new_tokens=max_new, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, **kw)
    answers = []
    for row in out[:, width:].tolist():
        if tok.eos_token_id in row:
            row = row[: row.index(tok.eos_token_id) + 1]
        answers.append(row)
    return answers


# -- shared-prefix forward passes (calc: every row starts with the same ~200-token system prompt) -----

def common_prefix_len(rows: list[list[int]]) -> int:
    n = min(map(len, rows))
    for i in range(n):
        if any(r[i] != rows[0][i] for r in rows):
            return i
    return n


@torch.no_grad()
def sample_shared(model, rows: list[list[int]], do_sample: bool, max_new: int, eos: int, pad: int):
    """Continue every row (temperature 1, top_k 0, top_p 1, or greedy) until its EOS or `max_new`
    tokens: (the new tokens of each row, EOS included; their logprobs under the sampling model, the
    behaviour logprobs vLLM returns). The rows' common prefix is run once and its keys and values
    repeated across the batch; the rest of each row is padded in the middle (attention mask 0,
    positions continuing from the prefix), so each row is computed exactly as if alone."""
    shared = min(common_prefix_len(rows), min(map(len, rows)) - 1)
    rest = [r[shared:] for r in rows]
    width = max(map(len, rest))
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rest])
    own = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rest])
    pos = (shared + own.cumsum(-1) - 1).clamp(min=shared)
    attn = torch.cat([torch.ones(len(rows), shared, dtype=own.dtype), own], 1)
    cache = None
    if shared:
        cache = model(input_ids=torch.tensor([rows[0][:shared]]), use_cache=True).past_key_values
        cache.batch_repeat_interleave(len(rows))
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, past_key_values=cache, use_cache=True)
    turns = [[] for _ in rows]
    lps = [[] for _ in rows]
    done = torch.zeros(len(rows), dtype=torch.bool)
    last = pos[:, -1]
    for _ in range(max_new):
        logsm = out.logits[:, -1].float().log_softmax(-1)
        nxt = torch.multinomial(logsm.exp(), 1).squeeze(-1) if do_sample else logsm.argmax(-1)
        chosen = logsm.gather(-1, nxt[:, None]).squeeze(-1)
        for b in (~done).nonzero().flatten().tolist():
            turns[b].append(int(nxt[b]))
            lps[b].append(float(chosen[b]))
        done |= nxt == eos
        if bool(done.all()):
            break
        nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
        last = last + 1
        attn = torch.cat([attn, torch.ones(len(rows), 1, dtype=attn.dtype)], 1)
        out = model(input_ids=nxt[:, None], attention_mask=attn, position_ids=last[:, None],
                    past_key_values=out.past_key_values, use_cache=True)
    return turns, lps


def shared_prefix_logp(model, mb, with_entropy: bool, min_shared: int = 16):
    """token_logprobs(model(mb).logits, mb.targets) where the loss can use it (from the first trained
    target on; 0 before, where the loss mask is 0), with the rows' common prefix run once (gradient
    included) and its keys and values repeated across the micro-batch: the same loss and gradients as
    the trainer's full forward, at a fraction of its cost when a long system prompt is shared."""
    ids, attn = mb.input_ids, mb.attention_mask
    trained = mb.loss_mask.sum(0).nonzero()
    first = int(trained[0]) if len(trained) else ids.shape[1] - 1
    shared = min(common_prefix_len(ids.tolist()), first + 1, ids.shape[1] - 1)
    if shared < min_shared:
        return token_logprobs(model(input_ids=ids, attention_mask=attn).logits, mb.targets, with_entropy)
    head = model(input_ids=ids[:1, :shared], use_cache=True, logits_to_keep=1)
    cache = head.past_key_values
    cache.batch_repeat_interleave(ids.shape[0])
    tail = model(input_ids=ids[:, shared:], attention_mask=attn, past_key_values=cache).logits
    logits = torch.cat([head.logits[:, -1:].expand(ids.shape[0], -1, -1), tail], 1)  # positions shared-1 ..
    logp, entropy = token_logprobs(logits, mb.targets[:, shared - 1:], with_entropy)
    front = torch.zeros(ids.shape[0], shared - 1, dtype=logp.dtype)
    return torch.cat([front, logp], 1), (torch.cat([front, entropy], 1) if entropy is not None else None)


# -- calc: the demo's two-turn tool session (seamlessflow/demo/rl.py calc_agent), offline -------------

def tool_glue_ids(tok, turn: list[int], results: list[str]) -> list[int]:
    """The tokens the chat template puts between an assistant's tool-call turn and the next
    assistant turn: its end of turn (when the sampled turn lacks one: cut by max_new), one `tool`
    turn per result, the next assistant header (the trajectory manager appends the same; never trained)."""
    end = [] if turn and turn[-1] == tok.eos_token_id else [tok.eos_token_id]
    tools = "".join(f"<|im_start|>tool\n{r}<|im_end|>\n" for r in results)
    return end + tok.encode(f"\n{tools}<|im_start|>assistant\n", add_special_tokens=False)


@dataclass
class CalcSession:
    """One calc session as the probe ran it: the token pieces (prompt, the first turn, the template's
    glue and the second turn, both empty without a tool call) with the sampled turns' behaviour
    logprobs, the final answer and the tool's results."""

    prompt: list[int]
    first: list[int]
    first_lp: list[float] = field(default_factory=list)
    glue: list[int] = field(default_factory=list)
    second: list[int] = field(default_factory=list)
    second_lp: list[float] = field(default_factory=list)
    answer: str = ""
    results: list[str] = field(default_factory=list)
    finished: bool = True  # False: the second turn called a tool again (the demo's agent then scores 0)

    def reward(self, target: str) -> float:
        return calc_reward(self.answer, target, self.results) if self.finished else 0.0

    def sample(self, version: int) -> Sample:
        """The session's token-exact path: the two sampled turns trained (mask 1), prompt and glue not."""
        ids = self.prompt + self.first + self.glue + self.second
        mask = [0] * len(self.prompt) + [1] * len(self.first) + [0] * len(self.glue) + [1] * len(self.second)
        lps = [0.0] * len(self.prompt) + self.first_lp + [0.0] * len(self.glue) + self.second_lp
        return Sample(ids, mask, lps, [version if m else -1 for m in mask])


def _turn_text(tok, ids: list[int]) -> str:
    return tok.decode([i for i in ids if i != tok.eos_token_id], skip_special_tokens=False)


def calc_sessions(model, tok, questions: list[str], do_sample: bool, max_new: int) -> list[CalcSession]:
    """Both turns of every question, batched (sample_shared): the first turn with the calculator in
    the system prompt; where it calls the tool (shared/toolcalls.py parses it, tasks.calculator_call
    runs it), the results and a second turn, whose text is the answer; otherwise the first turn's is."""
    eos, pad = tok.eos_token_id, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    prompts = [_prompt_ids(tok, q, [CALCULATOR_TOOL]) for q in questions]
    turns, lps = sample_shared(model, prompts, do_sample, max_new, eos, pad)
    sessions = [CalcSession(p, t, lp) for p, t, lp in zip(prompts, turns, lps)]
    again = []
    for k, s in enumerate(sessions):
        content, calls = parse_tool_calls(_turn_text(tok, s.first), f"probe-{k}")
        if not calls:
            s.answer = content.strip()
            continue
        s.results = [calculator_call(c.arguments) for c in calls]
        s.glue = tool_glue_ids(tok, s.first, s.results)
        again.append(s)
    if again:
        turns, lps = sample_shared(model, [s.prompt + s.first + s.glue for s in again], do_sample, max_new, eos, pad)
        for s, turn, lp in zip(again, turns, lps):
            s.second, s.second_lp = turn, lp
            content, calls = parse_tool_calls(_turn_text(tok, turn), "probe-again")
            s.answer, s.finished = content.strip(), not calls
    return sessions


_INT = re.compile(r"-?\d[\d,]*")


def lenient_correct(answer: str, target: str) -> bool:
    """The last integer in the answer (commas dropped) is the target: right arithmetic in prose
    ("48 times 37 is 1,776."), which the task's exact match (answer == target) does not count."""
    found = _INT.findall(answer)
    return bool(found) and found[-1].replace(",", "") == target


@torch.no_grad()
def seq_logprobs(model, seqs, plens, pad_id):
    """Logprob of each answer token under `model` (the behaviour logprobs of the rollout)."""
    width = max(map(len, seqs))
    ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs])
    attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    logp, _ = token_logprobs(model(input_ids=ids, attention_mask=attn).logits[:, :-1], ids[:, 1:], False)
    out = []
    for b, (s, p) in enumerate(zip(seqs, plens)):
        out.append([0.0] * p + logp[b, p - 1: len(s) - 1].tolist())
    return out


class Evaluator:
    """A fixed set of `n` prompts of `task`, answered sampled (temperature 1) and greedy: the mean
    reward of each; for calc also the exact-answer rate (`*_exact`, the task's target hit), the
    lenient one (`*_lenient`: lenient_correct) and the fraction of sessions that called the tool."""

    def __init__(self, tok, n=256, seed=12345, task="reverse", max_new=MAX_NEW, modes="sampled,greedy",  # noqa: PLR0913  the eval set and how it is answered
                 level: CalcLevel = CalcLevel()):
        rng = random.Random(seed)
        self.modes = modes.split(",")
        self.task, self.max_new = task, max_new
        if task == "calc":
            self.tasks = [(q, a) for q, _, a in (calc_prompt(rng, level) for _ in range(n))]
        else:
            self.tasks = [reverse_prompt(rng) for _ in range(n)]
            self.prompts = [_prompt_ids(tok, t) for t, _ in self.tasks]
        self.tok = tok
        self.seed = seed
        self.shown: dict[str, list[dict]] = {}  # calc: the last eval's sessions, by mode (--show prints some)

    def __call__(self, model):
        model.eval()
        res = {}
        t0 = time.perf_counter()
        with torch.random.fork_rng():  # same sampling noise in every eval; training RNG untouched
            torch.manual_seed(self.seed)
            for name, sample in (("sampled", True), ("greedy", False)):
                if name not in self.modes:
                    continue
                if self.task == "calc":
                    res.update(self._calc(model, name, sample))
                    continue
                answers = generate(model, self.tok, self.prompts, sample, self.max_new)
                texts = self.tok.batch_decode(answers, skip_special_tokens=True)
                res[name] = sum(reverse_reward(a, tgt) for a, (_, tgt) in zip(texts, self.tasks)) / len(texts)
                if sample:
                    res["eos_frac"] = sum(self.tok.eos_token_id in a for a in answers) / len(answers)
                    res["len"] = sum(len(a) for a in answers) / len(answers)
        res["seconds"] = time.perf_counter() - t0
        return res

    def _calc(self, model, name: str, sample: bool) -> dict:
        sessions = calc_sessions(model, self.tok, [q for q, _ in self.tasks], sample, self.max_new)
        self.shown[name] = [{"q": q, "target": t, "first": _turn_text(self.tok, s.first), "results": s.results,
                             "answer": s.answer} for s, (q, t) in zip(sessions, self.tasks)]
        n = len(sessions)
        targets = [a for _, a in self.tasks]
        out = {name: sum(s.reward(t) for s, t in zip(sessions, targets)) / n,
               f"{name}_exact": sum(s.finished and s.answer == t for s, t in zip(sessions, targets)) / n,
               f"{name}_lenient": sum(s.finished and lenient_correct(s.answer, t) for s, t in zip(sessions, targets)) / n,
               f"{name}_tool": sum(bool(s.results) for s in sessions) / n,
               f"{name}_distinct": len({s.answer for s in sessions})}  # of n prompts: a collapse shows here
        if sample:
            out["eos_frac"] = sum(self.tok.eos_token_id in (s.second or s.first) for s in sessions) / n
            out["len"] = sum(len(s.first) + len(s.second) for s in sessions) / n
        return out


DEFAULTS = {
    "model": "/tmp/probe/warm0.3", "steps": 60, "seed": 0, "task_seed": 1, "eval_every": 10, "eval_n": 256,
    # TrainerConfig engine/data knobs (defaults: seamlessflow/demo/rl.py TRAINER_SETTINGS)
    "lr": 3e-4, "lr_warmup_steps": 5, "beta1": 0.9, "beta2": 0.999, "adam_eps": 1e-8, "weight_decay": 0.0,
    "grad_clip": 1.0, "ppo_epochs": 1, "group_size": 8, "groups_per_step": 4, "micro_batch_tokens": 4096,
    # AlgoConfig knobs
    "advantage": "grpo", "std_normalize": True, "group_baseline": False, "clip_low": 0.2, "clip_high": 0.2,
    "decoupled": True, "tis": True, "tis_cap": 2.0, "entropy_coef": 0.0, "aggregation": "token-mean",
    "drop_uniform_groups": False, "kl_coef": 0.0,
    # LoRA, the trainer's own (services/trainer/lora.py via TrainerConfig): rank 0 = full fine-tune;
    # alpha 0 = 2 x rank; targets: attn, mlp, all or module names separated by commas
    "lora_rank": 0, "lora_alpha": 0.0, "lora_targets": "all",
    # the reward the trainer sees: "answer" (tasks.answer_reward, what the demo reports) or another
    # shaping of tasks.REVERSE_SHAPINGS; batch_reward, loop_gain and the evals always use answer_reward
    "reward": "answer",
    # the task: "reverse" (the tiny model's warm starts) or "calc" (the demo's two-turn calculator session
    # through the model's own chat template, e.g. SmolLM2); max_new: tokens a turn (0 = the task's:
    # reverse MAX_NEW, calc CALC_MAX_NEW); calc's trainer reward is tasks.calc_reward, as in the demo
    "task": "reverse", "max_new": 0, "show": 0,  # show: print this many calc eval sessions at each eval
    # calc's difficulty (tasks.CalcLevel; the defaults are the demo's task): operands 2..max, operators,
    # an instruction appended to the question
    "calc_max_operand": 99, "calc_ops": "+-*", "calc_hint": "",
    # calc's trainer reward: "task" (tasks.calc_reward, the demo's) or "lenient" (calc_lenient_reward: the
    # right number inside prose earns half the answer's credit); batch_reward and the evals report "task"
    "calc_reward": "task",
    # evals: eval_start False skips the step-0 eval (the base figure measured once, by a --steps 0 run at the
    # same eval_n); eval_modes: "sampled,greedy" or one of them; dump: append each calc eval's sessions (JSONL)
    "eval_start": True, "eval_modes": "sampled,greedy", "dump": "",
    # probe
    "name": "", "quiet": False, "save": "",  # save: write the final model here ("" = no)
    # off-policy emulation (issue 26): step t samples from the policy of step max(0, t - staleness) (a
    # snapshot of its weights), its behaviour logprobs and token versions that snapshot's, and trains
    # the current policy on it, as the demo's trainer does with tokens `staleness` versions old
    "staleness": 0,
    # calc only, full fine-tune: a supervised warm start before RL (issue 26: SmolLM2 never calls the tool,
    # so RL has no signal): sft_steps steps of sft_batch examples (warmstart.sft_example at the run's
    # CalcLevel: the call in the model's own template, the tool's result, the answer; the eval's questions
    # left out) at sft_lr (AdamW, grad clip 1); with sft_target > 0 it stops once the sampled exact rate on
    # sft_check_n other prompts, checked every sft_check_every steps, reaches sft_target (RL keeps headroom).
    # The KL reference (kl_coef) is then the SFT'd model. --steps 0 --save DIR keeps the SFT start alone.
    "sft_steps": 0, "sft_batch": 16, "sft_lr": 5e-5, "sft_target": 0.0, "sft_check_every": 5, "sft_check_n": 64,
    # a wall-clock budget for RL (issue 26: "within 30 minutes here"), 0 = none: no step starts that would end
    # past it (judged by the last step's time), its periodic evals included; then one final eval, outside it
    "time_budget_s": 0.0,
}


def calc_level(o: dict) -> CalcLevel:
    return CalcLevel(o["calc_max_operand"], o["calc_ops"], o["calc_hint"])


def max_new_tokens(o: dict) -> int:
    return o["max_new"] or (CALC_MAX_NEW if o["task"] == "calc" else MAX_NEW)


def rollout(model, tok, rng: random.Random, o: dict, step: int, pad_id: int) -> tuple[list, list[float], list, list]:
    """G prompts x group_size samples from `model` (the policy of version `step`): (groups, rewards,
    each session's last turn, whether each hit the target exactly)."""
    if o["task"] == "calc":
        return calc_rollout(model, tok, rng, o, step, pad_id)
    model.eval()
    tasks = [reverse_prompt(rng) for _ in range(o["groups_per_step"])]
    prompts = [_prompt_ids(tok, t) for t, _ in tasks for _ in range(o["group_size"])]
    answers = generate(model, tok, prompts, True, max_new_tokens(o))
    texts = tok.batch_decode(answers, skip_special_tokens=True)
    targets = [tgt for _, tgt in tasks for _ in range(o["group_size"])]
    rewards = [reverse_reward(a, t) for a, t in zip(texts, targets)]  # what the demo reports
    shaped = REVERSE_SHAPINGS[o["reward"]]
    train_rewards = [shaped(a, t) for a, t in zip(texts, targets)]
    seqs = [p + a for p, a in zip(prompts, answers)]
    behav = seq_logprobs(model, seqs, [len(p) for p in prompts], pad_id)
    groups = []
    for g in range(o["groups_per_step"]):
        grp = []
        for k in range(o["group_size"]):
            i = g * o["group_size"] + k
            p, n = len(prompts[i]), len(answers[i])
            s = Sample(seqs[i], [0] * p + [1] * n, behav[i], [-1] * p + [step] * n)
            grp.append(TrajectoryCompleted(f"s{step}-{i}", f"g{step}-{g}", train_rewards[i], [s]))
        groups.append(grp)
    return groups, rewards, answers, [r == 1.0 for r in rewards]


def calc_lenient_reward(answer: str, target: str, tool_results: list[str]) -> float:
    """tasks.calc_reward with the answer's credit at least half of CALC_CORRECT where the answer's last
    integer is the target (lenient_correct): a chat model that answers "2 + 3 = 5" earns 0.3, the bare
    "5" 0.6, where the task's own reward gives the first ~0 (position-wise "2" against "5")."""
    base = calc_reward(answer, target, tool_results)
    floor = 0.5 * CALC_CORRECT if lenient_correct(answer, target) else 0.0
    return base + max(0.0, floor - CALC_CORRECT * answer_reward(answer, target))


def calc_rollout(model, tok, rng: random.Random, o: dict, step: int, pad_id: int) -> tuple[list, list[float], list, list]:
    """rollout on calc: each session both turns (calc_sessions), one Sample of its whole path, the
    demo's reward (tasks.calc_reward); exact = the final answer is the true result."""
    model.eval()
    problems = [calc_prompt(rng, calc_level(o)) for _ in range(o["groups_per_step"])]
    questions = [q for q, _, _ in problems for _ in range(o["group_size"])]
    targets = [a for _, _, a in problems for _ in range(o["group_size"])]
    sessions = calc_sessions(model, tok, questions, True, max_new_tokens(o))
    rewards = [s.reward(t) for s, t in zip(sessions, targets)]  # the task's, what the demo reports
    train = rewards if o["calc_reward"] == "task" else \
        [calc_lenient_reward(s.answer, t, s.results) if s.finished else 0.0 for s, t in zip(sessions, targets)]
    groups = []  # behaviour logprobs: the sampler's own, as vLLM returns them
    for g in range(o["groups_per_step"]):
        idx = range(g * o["group_size"], (g + 1) * o["group_size"])
        groups.append([TrajectoryCompleted(f"s{step}-{i}", f"g{step}-{g}", train[i], [sessions[i].sample(step)])
                       for i in idx])
    exact = [s.finished and s.answer == t for s, t in zip(sessions, targets)]
    return groups, rewards, [s.second or s.first for s in sessions], exact


def trainer_config(o: dict) -> TrainerConfig:
    """The TrainerConfig of a run's options (its engine and LoRA knobs), validated as the trainer does."""
    return TrainerConfig(model_dir=o["model"], lr=o["lr"], lr_warmup_steps=o["lr_warmup_steps"], beta1=o["beta1"],
                         beta2=o["beta2"], adam_eps=o["adam_eps"], weight_decay=o["weight_decay"],
                         grad_clip=o["grad_clip"], ppo_epochs=o["ppo_epochs"], lora_rank=o["lora_rank"],
                         lora_alpha=o["lora_alpha"], lora_targets=o["lora_targets"])


def build_policy(o: dict):
    """(policy, optimizer, lr scheduler, KL reference) as TrainEngine builds them at world size 1:
    with lora_rank > 0 the model is lora.wrap'ed (base frozen, the adapter alone trained) and the
    reference is the policy itself, run under `lora.adapter_disabled` (`reference` below); without
    LoRA a second frozen copy when kl_coef != 0. The optimizer is optim.adamw over the trainable
    parameters, the lr warm-up the engine's LambdaLR."""
    from transformers import AutoModelForCausalLM

    cfg = trainer_config(o)
    model = AutoModelForCausalLM.from_pretrained(o["model"], dtype=torch.float32)
    spec = lora.lora_spec(cfg)
    if spec is not None:
        model = lora.wrap(model, spec, cfg.model_dir)
    ref = None
    if o["kl_coef"]:
        ref = model if spec is not None else \
            AutoModelForCausalLM.from_pretrained(o["model"], dtype=torch.float32).eval().requires_grad_(False)
    opt, _sit_out = optim.adamw(cfg, {"": [p for p in model.parameters() if p.requires_grad]})
    warmup = max(cfg.lr_warmup_steps, 0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
    return model, opt, sched, ref


@contextlib.contextmanager
def reference(model, ref):
    """The module that computes the KL reference: `ref` itself, or, when it is the (LoRA) policy,
    the policy with its adapter off, as engine._ref_pass does."""
    if ref is model:
        with lora.adapter_disabled(model):
            yield model
    else:
        yield ref


class Behaviour:
    """The policy rollout samples from: the live model, or with `staleness` K > 0 a copy holding the
    weights after step max(0, t - K), kept as CPU copies. With LoRA the copy is the PEFT model (base
    and adapter) and a version's state dict carries the adapter's weights with the frozen base's."""

    def __init__(self, model, staleness: int):
        import copy

        self.live, self.staleness, self.version = model, staleness, 0
        self.model = copy.deepcopy(model).eval().requires_grad_(False) if staleness else model
        self.states = {0: self._copy(model)} if staleness else {}

    @staticmethod
    def _copy(model) -> dict:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def stepped(self, version: int) -> None:
        """The live model has now taken `version` steps; versions no later step samples from are dropped."""
        if self.staleness:
            self.states[version] = self._copy(self.live)
            for v in [v for v in self.states if v < version - self.staleness]:
                del self.states[v]

    def policy(self, step: int):
        """The model that samples step `step`'s batch (its version is then `self.version`)."""
        version = max(0, step - self.staleness)
        if self.staleness and (version != self.version or step == 0):
            self.model.load_state_dict(self.states[version])
        self.version = version
        return self.model


def train_step(model, optim: tuple, gb, algo: AlgoConfig, o: dict, pad_id: int,  # noqa: PLR0913  the engine's inputs
               ref=None) -> tuple[list[dict], torch.Tensor]:
    """TrainEngine.train_step at world size 1, without DeepSpeed: (each micro-batch's metrics, the grad norm).
    `optim`: (optimizer, lr scheduler)."""
    opt, sched = optim
    batches = micro_batches(gb.rows, o["micro_batch_tokens"], pad_id)
    norm_tokens = float(sum(mb.num_tokens for mb in batches))
    norm_seqs = float(sum(mb.num_seqs for mb in batches))
    model.train()
    prox = [None] * len(batches)
    parts = []
    for _epoch in range(o["ppo_epochs"]):
        opt.zero_grad(set_to_none=True)
        for i, mb in enumerate(batches):
            if o["task"] == "calc":  # the same logprobs as the full forward below, the system prompt run once
                logp, entropy = shared_prefix_logp(model, mb, True)
            else:
                logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
                logp, entropy = token_logprobs(logits, mb.targets, True)
            if prox[i] is None:
                prox[i] = logp.detach()
            if algo.entropy_coef == 0.0:
                entropy = entropy.detach()
            ref_logp = None
            if ref is not None:
                with torch.no_grad(), reference(model, ref) as base:
                    ref_logp = shared_prefix_logp(base, mb, False)[0] if o["task"] == "calc" else \
                        token_logprobs(base(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits,
                                       mb.targets, False)[0]
            loss, m = policy_loss(logp, prox[i], mb.behav_logprobs, mb.advantages, mb.loss_mask, algo,
                                  ref_logp=ref_logp, entropy=entropy, num_tokens=norm_tokens, num_seqs=norm_seqs)
            loss.backward()
            parts.append(m)
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), o["grad_clip"] if o["grad_clip"] > 0 else 1e30)
        opt.step()
        sched.step()
    return parts, gn


def sft_calc(model, tok, o: dict, held_out: set[str], log) -> dict:
    """The supervised warm start of `--sft-steps` (DEFAULTS says what it does; warmstart.calc_sft, which
    `demo --model smollm2` runs too): {steps, loss, seconds, checks}."""
    from seamlessflow.demo.warmstart import CalcSFT, calc_sft

    if o["task"] != "calc" or o["lora_rank"] or o["staleness"]:
        raise ValueError("--sft-steps: calc, full fine-tune, staleness 0 only")
    level = calc_level(o)
    check = Evaluator(tok, o["sft_check_n"], seed=54321, task="calc", max_new=max_new_tokens(o), modes="sampled",
                      level=level) if o["sft_target"] > 0 else None
    checks: list[dict] = []

    def checked(step: int) -> bool:  # True: the sampled exact rate reached --sft-target
        if check is None or (step % o["sft_check_every"] and step != o["sft_steps"]):
            return False
        res = check(model)
        checks.append({"step": step, **{k: round(v, 4) for k, v in res.items()}})
        log(f"[sft-check] step {step} exact {res['sampled_exact']:.3f} tool {res['sampled_tool']:.3f}")
        return res["sampled_exact"] >= o["sft_target"]

    sft = CalcSFT(steps=o["sft_steps"], batch=o["sft_batch"], lr=o["sft_lr"], seed=o["seed"], level=level)
    return {**calc_sft(model, tok, sft, held_out, log=log, after_step=checked), "checks": checks}


def sft_start(model, ref, tok, o: dict, evaluate: Evaluator, log) -> dict:
    """sft_calc on `model`, the evals' questions held out; the KL reference (if any) then is the SFT'd
    model, so the KL term keeps RL near its start, not near the base model."""
    res = sft_calc(model, tok, o, {q for q, _ in evaluate.tasks}, log)
    if ref is not None:
        ref.load_state_dict(model.state_dict())
    return res


def group_distinct(answers: list[list[int]], group_size: int) -> float:
    """Distinct final turns a group, the mean over the batch's groups (1: every sample of a group the same)."""
    rows = [tuple(a) for a in answers]
    return _mean([len(set(rows[i:i + group_size])) for i in range(0, len(rows), group_size)])


def eval_and_log(evaluate: Evaluator, model, step: int, o: dict, log) -> dict:
    res = evaluate(model)
    if o["dump"]:
        with open(o["dump"], "a") as f:
            f.write(json.dumps({"step": step, "sessions": evaluate.shown}) + "\n")
    log(f"[eval] step {step:3d} " + " ".join(f"{k} {v:.3f}" for k, v in res.items()))
    for mode, shown in evaluate.shown.items():
        for sess in shown[: o["show"]]:
            log(f"[show] {mode} {json.dumps(sess)}")
    return res


def run(opts: dict) -> dict:  # noqa: PLR0915  one loop, read top to bottom like the trainer's step
    from transformers import AutoTokenizer

    o = {**DEFAULTS, **opts}
    algo = AlgoConfig(advantage=o["advantage"], std_normalize=o["std_normalize"],
                      group_baseline=o["group_baseline"], clip_low=o["clip_low"], clip_high=o["clip_high"],
                      decoupled=o["decoupled"], tis=o["tis"], tis_cap=o["tis_cap"],
                      entropy_coef=o["entropy_coef"], aggregation=o["aggregation"],
                      drop_uniform_groups=o["drop_uniform_groups"], kl_coef=o["kl_coef"])
    torch.manual_seed(o["seed"])
    rng = random.Random(o["task_seed"] * 1000 + o["seed"])
    tok = AutoTokenizer.from_pretrained(o["model"])
    model, opt, sched, ref = build_policy(o)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    evaluate = Evaluator(tok, o["eval_n"], task=o["task"], max_new=max_new_tokens(o), modes=o["eval_modes"],
                         level=calc_level(o))
    log = (lambda *a: None) if o["quiet"] else (lambda *a: print(*a, flush=True))
    evals, batch_rewards, batch_exact, batch_train, step_metrics, batch_distinct = {}, [], [], [], [], []
    sft = sft_start(model, ref, tok, o, evaluate, log) if o["sft_steps"] else None
    t_steps = 0.0
    behaviour = Behaviour(model, o["staleness"])
    t_rl, dt, rl_wall = time.perf_counter(), 0.0, None

    def over() -> bool:  # the next step (as long as the last one) would end past the budget
        return bool(o["time_budget_s"]) and time.perf_counter() - t_rl + dt > o["time_budget_s"]

    for step in range(o["steps"] + 1):
        periodic = o["eval_every"] and step % o["eval_every"] == 0 and (step or o["eval_start"] or not o["steps"])
        if periodic and not over():
            evals[step] = eval_and_log(evaluate, model, step, o, log)
        if step == o["steps"] or over():
            rl_wall = time.perf_counter() - t_rl
            if o["eval_every"] and step not in evals and (periodic or step < o["steps"]):
                evals[step] = eval_and_log(evaluate, model, step, o, log)  # the final eval, outside the budget
            break
        t0 = time.perf_counter()
        # 1. rollout: G prompts x group_size samples from the current policy (with staleness: an older one)
        groups, rewards, answers, exact = rollout(behaviour.policy(step), tok, rng, o, behaviour.version, pad_id)
        # 2. the trainer's step (TrainEngine.train_step, world size 1, no DeepSpeed)
        gb = build_global_batch(groups, algo)
        parts, gn = train_step(model, (opt, sched), gb, algo, o, pad_id, ref)
        dt = time.perf_counter() - t0
        t_steps += dt
        m = merge_metrics(parts)
        m.update(gb.metrics, grad_norm=float(gn), lr=opt.param_groups[0]["lr"])
        step_metrics.append({k: round(v, 4) for k, v in m.items()})
        batch_rewards.append(sum(rewards) / len(rewards))
        batch_exact.append(sum(exact) / len(exact))
        batch_train.append(sum(t.reward for grp in groups for t in grp) / len(rewards))
        batch_distinct.append(group_distinct(answers, o["group_size"]))
        eos = sum(tok.eos_token_id in a for a in answers) / len(answers)
        log(f"step {step:3d} reward {batch_rewards[-1]:.3f} train {batch_train[-1]:.3f} exact {batch_exact[-1]:.3f} "
            f"distinct {batch_distinct[-1]:.1f} adv_std {m['adv_std']:.2f} "
            f"ent {m.get('entropy', 0):.3f} clip {m['clip_frac']:.3f} gnorm {float(gn):.2f} eos {eos:.2f} {dt:.2f}s")
        behaviour.stepped(step + 1)
    if o["save"]:  # a LoRA run saves base + adapter merged: a plain HF model, a warm start like any other
        (model.merge_and_unload() if o["lora_rank"] else model).save_pretrained(o["save"], safe_serialization=True)
        tok.save_pretrained(o["save"])
    res = {
        "name": o["name"], "opts": {k: v for k, v in o.items() if k in opts},
        "eval": {str(k): {kk: round(vv, 4) for kk, vv in v.items()} for k, v in evals.items()},
        "batch_reward": [round(r, 3) for r in batch_rewards],
        "batch_exact": [round(r, 3) for r in batch_exact],
        "batch_train_reward": [round(r, 3) for r in batch_train],  # the reward the trainer saw (its shaping)
        "batch_distinct": [round(r, 2) for r in batch_distinct],  # distinct final turns a group, mean
        "sft": sft,
        # the demo's figure: in-loop mean reward, first 8 steps -> last 8 steps, and the lowest
        # 8-step rolling mean below the first 8 (the "dip")
        "loop_gain": round(_mean(batch_rewards[-8:]) - _mean(batch_rewards[:8]), 3),
        "loop_dip": round(_mean(batch_rewards[:8]) - min(_mean(batch_rewards[max(0, i - 7):i + 1])
                                                         for i in range(7, len(batch_rewards))), 3)
        if len(batch_rewards) >= 8 else 0.0,
        "exact_gain": round(_mean(batch_exact[-8:]) - _mean(batch_exact[:8]), 3),
        "groups_dropped": sum(m.get("groups_dropped", 0) for m in step_metrics),
        "sec_per_step": round(t_steps / max(len(step_metrics), 1), 3),
        "steps_run": len(step_metrics),
        "rl_wall_s": round(rl_wall, 1) if rl_wall is not None else None,  # steps and evals before the last eval
        "trainable_params": trainable,
        "final_entropy": step_metrics[-1].get("entropy") if step_metrics else None,
        "entropy": [m.get("entropy") for m in step_metrics],
        "grad_norm": [m["grad_norm"] for m in step_metrics],
    }
    return res


def prepare(dirpath: Path, targets: list[float], warm_steps: list[int]) -> None:
    """The tiny model as tests/conftest.py builds it, then warm starts with warmstart.warm_start."""
    import shutil

    from seamlessflow.modelgen import init_model
    from seamlessflow.demo.warmstart import WarmStart, warm_start

    tiny = dirpath / "tiny"
    if not (tiny / "config.json").exists():
        init_model(tiny, size="tiny")
    for t in targets:
        out = dirpath / f"warm{t}"
        if not (out / "config.json").exists():
            print(f"target {t}:", warm_start(tiny, out, WarmStart(target_reward=t)), flush=True)
    for n in warm_steps:  # fixed step counts (warm_start checks its target every 25 steps only)
        out = dirpath / f"warmsteps{n}"
        if not (out / "config.json").exists():
            print(f"steps {n}:", warm_start(tiny, out, WarmStart(target_reward=9.0, max_steps=n)), flush=True)
            for extra in ("generation_config.json",):
                if (tiny / extra).exists() and not (out / extra).exists():
                    shutil.copy(tiny / extra, out / extra)


def _mean(xs) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _bool(s: str) -> bool:
    return s.lower() in ("1", "true", "yes", "y")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--dir", default="/tmp/probe")
    p.add_argument("--targets", type=float, nargs="*", default=[0.3])
    p.add_argument("--warm-steps", type=int, nargs="*", default=[])
    r = sub.add_parser("run")
    for k, v in DEFAULTS.items():
        typ = _bool if isinstance(v, bool) else type(v)
        r.add_argument("--" + k.replace("_", "-"), type=typ, default=v)
    s = sub.add_parser("sweep")
    s.add_argument("grid", help="JSON file: a list of option dicts")
    s.add_argument("--out", default="-")
    a = ap.parse_args(argv)
    if a.cmd == "prepare":
        prepare(Path(a.dir), a.targets, a.warm_steps)
    elif a.cmd == "run":
        opts = {k: getattr(a, k) for k in DEFAULTS if getattr(a, k) != DEFAULTS[k]}
        print(json.dumps(run(opts)))
    else:
        grid = json.loads(Path(a.grid).read_text())
        out = sys.stdout if a.out == "-" else open(a.out, "a")  # noqa: SIM115
        for opts in grid:
            t0 = time.perf_counter()
            res = run({"quiet": True, **opts})
            res["wall_s"] = round(time.perf_counter() - t0, 1)
            ev = res["eval"]
            print(f"# {res['name'] or opts}: gain {res['loop_gain']:+.3f} dip {res['loop_dip']:.3f} " + " ".join(f"{k}:{v['sampled']:.3f}/{v['greedy']:.3f}"
                                                         for k, v in ev.items()), file=sys.stderr, flush=True)
            out.write(json.dumps(res) + "\n")
            out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
