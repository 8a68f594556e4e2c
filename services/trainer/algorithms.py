"""Advantage estimators and the staleness-aware policy loss: pure torch, no I/O.

Owns the RL maths of one step:
- a registry of advantage estimators selected by name (`grpo`, `rloo`,
  `reinforce_pp`), mapping one scalar reward per trajectory to one advantage;
- the PPO-clip policy loss with decoupled-PPO staleness correction, truncated
  importance sampling, an optional k3 KL to a reference policy and an optional
  entropy bonus;
- loss aggregation (`token-mean`, `seq-mean`) with caller-given normalisers, so a
  global batch split into micro-batches (and ranks) still averages once.

It does not know models, tokenizers, DeepSpeed, micro-batching or messages: it
sees tensors of log-probabilities, masks and rewards.

Decoupled PPO (Hilton et al. 2022, as used by AReaL), per generated token t:
    ratio_t = exp(logp_t - logp_prox_t)          # current vs proximal policy
    w_t     = min(exp(logp_prox_t - logp_behav_t), cap)   # truncated IS, detached
    loss_t  = w_t * max(-A * ratio_t, -A * clip(ratio_t, 1 - eps_low, 1 + eps_high))
logp_prox is the policy the trainer holds before this update, recomputed on the
trainer; logp_behav is what the rollout engine recorded (possibly older versions,
possibly a different kernel). With `decoupled=False` the proximal policy is the
behaviour policy itself (plain PPO against rollout logprobs) and w_t = 1.
"""

from __future__ import annotations

from typing import Callable

import msgspec
import torch

Tensor = torch.Tensor
AGGREGATIONS = ("token-mean", "seq-mean")


class AlgoConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Knobs of the loss; defaults are plain GRPO with decoupled PPO and truncated IS."""

    advantage: str = "grpo"  # a key of ADVANTAGES
    std_normalize: bool = True  # grpo: divide by the group std (False = Dr.GRPO)
    group_baseline: bool = False  # reinforce_pp: subtract the group mean before whitening
    adv_eps: float = 1e-6
    clip_low: float = 0.2
    clip_high: float = 0.2  # > clip_low is DAPO's clip-higher
    decoupled: bool = True  # ratio against recomputed proximal logprobs, not behaviour ones
    tis: bool = True  # weight tokens by min(pi_prox / pi_behav, tis_cap)
    tis_cap: float = 2.0
    kl_coef: float = 0.0  # k3 KL to the reference model; 0 = no reference model
    entropy_coef: float = 0.0  # entropy bonus (subtracted from the loss)
    aggregation: str = "token-mean"
    # dynamic sampling (DAPO, Yu et al. 2025): leave groups whose rewards are all equal out of the
    # batch (their advantages are 0, so they only dilute the token-mean); kept if all are equal
    drop_uniform_groups: bool = False

    def __post_init__(self):
        if self.advantage not in ADVANTAGES:
            raise ValueError(f"unknown advantage {self.advantage!r}; choose one of {sorted(ADVANTAGES)}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation {self.aggregation!r}; choose one of {AGGREGATIONS}")
        if self.tis_cap <= 0 or self.clip_low < 0 or self.clip_high < 0:
            raise ValueError("tis_cap must be > 0 and clip bounds >= 0")


# --- advantages: one scalar per trajectory --------------------------------------------

AdvantageFn = Callable[[Tensor, Tensor, AlgoConfig], Tensor]
ADVANTAGES: dict[str, AdvantageFn] = {}


def register(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    def deco(fn: AdvantageFn) -> AdvantageFn:
        ADVANTAGES[name] = fn
        return fn

    return deco


def compute_advantages(rewards: Tensor, groups: Tensor, cfg: AlgoConfig) -> Tensor:
    """rewards: [N] float, one per trajectory; groups: [N] long group index (0..G-1)."""
    rewards = rewards.to(torch.float64)  # advantages are cheap; keep them exact
    return ADVANTAGES[cfg.advantage](rewards, groups.long(), cfg).to(torch.float32)


def _group_stats(rewards: Tensor, groups: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-element group count, mean and unbiased std (std 0 for singleton groups)."""
    n_groups = int(groups.max()) + 1 if groups.numel() else 0
    count = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(0, groups, torch.ones_like(rewards))
    total = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(0, groups, rewards)
    mean = (total / count)[groups]
    sq = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(0, groups, (rewards - mean) ** 2)
    var = sq / (count - 1).clamp(min=1)
    return count[groups], mean, var.sqrt()[groups]


@register("grpo")
def grpo(rewards: Tensor, groups: Tensor, cfg: AlgoConfig) -> Tensor:
    """GRPO (Shao et al. 2024): (r - mean_g) / (std_g + eps); Dr.GRPO (Liu et al. 2025): r - mean_g.

    std is the unbiased (Bessel) group std, as in verl and TRL. A singleton group
    has no baseline to compare against, so its advantage is 0.
    """
    _, mean, std = _group_stats(rewards, groups)
    adv = rewards - mean
    return adv / (std + cfg.adv_eps) if cfg.std_normalize else adv


@register("rloo")
def rloo(rewards: Tensor, groups: Tensor, cfg: AlgoConfig) -> Tensor:
    """RLOO (Ahmadian et al. 2024): r_i - mean_{j != i} r_j = n/(n-1) * (r_i - mean_g); 0 if n = 1."""
    count, mean, _ = _group_stats(rewards, groups)
    scale = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.zeros_like(count))
    return scale * (rewards - mean)


@register("reinforce_pp")
def reinforce_pp(rewards: Tensor, groups: Tensor, cfg: AlgoConfig) -> Tensor:
    """REINFORCE++ (Hu 2025), outcome reward: whiten over the whole global batch.

    (r - mean_batch) / (std_batch + eps), unbiased std. With `group_baseline` it is
    REINFORCE++-baseline: the group mean is subtracted first. The paper's per-token
    KL-in-reward is not used here; KL goes into the loss (`kl_coef`).
    """
    if cfg.group_baseline:
        _, mean, _ = _group_stats(rewards, groups)
        rewards = rewards - mean
    if rewards.numel() < 2:
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean()) / (rewards.std(unbiased=True) + cfg.adv_eps)


# --- policy loss: per token ------------------------------------------------------------


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 >= 0."""
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - log_ratio - 1.0


def aggregate(per_token: Tensor, mask: Tensor, mode: str, num_tokens: float | None = None,
              num_seqs: float | None = None) -> Tensor:
    """Reduce a [B, T] loss to a scalar.

    token-mean: sum over all masked tokens / num_tokens (every token weighs the same).
    seq-mean:   each row's masked-token mean, summed / num_seqs (every sequence weighs the same).
    The normalisers default to this batch's counts; pass the global batch's counts
    (divided by the data-parallel world size) when the batch is one micro-batch of many.
    """
    mask = mask.to(per_token.dtype)
    if mode == "token-mean":
        denom = mask.sum() if num_tokens is None else torch.tensor(float(num_tokens))
        return (per_token * mask).sum() / denom.clamp(min=1)
    if mode == "seq-mean":
        row_tokens = mask.sum(-1)
        row_mean = (per_token * mask).sum(-1) / row_tokens.clamp(min=1)
        denom = (row_tokens > 0).sum() if num_seqs is None else torch.tensor(float(num_seqs))
        return row_mean.sum() / denom.clamp(min=1)
    raise ValueError(f"unknown aggregation {mode!r}")


def policy_loss(  # noqa: PLR0913  one argument per term of the loss, each a tensor its math names
    logp: Tensor,
    logp_prox: Tensor,
    logp_behav: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: AlgoConfig,
    *,
    ref_logp: Tensor | None = None,
    entropy: Tensor | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The decoupled PPO-clip loss of a [B, T] batch; returns (scalar loss, metrics).

    logp carries the gradient; logp_prox, logp_behav, ref_logp are treated as
    constants. advantages is [B] (one per row) or [B, T]. Metrics are means over
    masked tokens except `*_max`, plus `tokens`, the weight for merging them.
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    advantages = advantages.to(logp.dtype)
    mask_f = mask.to(logp.dtype)
    prox = (logp_prox if cfg.decoupled else logp_behav).detach()

    ratio = torch.exp(logp - prox)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg = torch.maximum(unclipped, clipped)

    raw_w = torch.exp(prox - logp_behav.detach()) if cfg.decoupled else torch.ones_like(logp)
    weight = raw_w.clamp(max=cfg.tis_cap) if cfg.tis else torch.ones_like(raw_w)
    per_token = weight * pg

    kl = None
    if ref_logp is not None and cfg.kl_coef != 0.0:
        kl = k3_kl(logp, ref_logp.detach())
        per_token = per_token + cfg.kl_coef * kl
    if entropy is not None and cfg.entropy_coef != 0.0:
        per_token = per_token - cfg.entropy_coef * entropy

    loss = aggregate(per_token, mask_f, cfg.aggregation, num_tokens, num_seqs)

    with torch.no_grad():
        n = mask_f.sum().clamp(min=1)

        def mean(x: Tensor) -> float:
            return float((x * mask_f).sum() / n)

        def masked_max(x: Tensor) -> float:
            return float(torch.where(mask_f > 0, x, torch.full_like(x, -torch.inf)).max()) if mask_f.any() else 0.0

        metrics = {
            "tokens": float(mask_f.sum()),
            "pg_loss": mean(pg),
            "clip_frac": mean((clipped > unclipped).to(logp.dtype)),
            "ratio_mean": mean(ratio),
            "is_weight_mean": mean(weight),
            "is_weight_max": masked_max(raw_w),
            "is_truncated_frac": mean((raw_w > cfg.tis_cap).to(logp.dtype)) if cfg.tis else 0.0,
        }
        if kl is not None:
            metrics["kl"] = mean(kl)
        if entropy is not None:
            metrics["entropy"] = mean(entropy)
    return loss, metrics


def merge_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """Token-weighted mean of per-micro-batch metrics; `*_max` keys take the max, `tokens` sums."""
    total = sum(p.get("tokens", 0.0) for p in parts)
    out: dict[str, float] = {"tokens": total}
    for key in {k for p in parts for k in p} - {"tokens"}:
        vals = [(p[key], p.get("tokens", 0.0)) for p in parts if key in p]
        if key.endswith("_max"):
            out[key] = max(v for v, _ in vals)
        else:
            out[key] = sum(v * w for v, w in vals) / total if total else 0.0
    return out


def advantage_metrics(rewards: Tensor, advantages: Tensor) -> dict[str, float]:
    rewards, advantages = rewards.double(), advantages.double()
    std = (lambda x: float(x.std()) if x.numel() > 1 else 0.0)
    return {
        "reward_mean": float(rewards.mean()) if rewards.numel() else 0.0,
        "reward_std": std(rewards),
        "adv_mean": float(advantages.mean()) if advantages.numel() else 0.0,
        "adv_std": std(advantages),
    }
