"""services/trainer/algorithms.py against an independent, loop-by-loop reading of the published formulas.

The reference below uses only `math` and `statistics` on Python floats: no torch,
no code shared with the module under test.
"""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from services.trainer.algorithms import (
    ADVANTAGES,
    AlgoConfig,
    aggregate,
    compute_advantages,
    k3_kl,
    merge_metrics,
    policy_loss,
)

EPS = 1e-6
# 4 groups: varied rewards, a tie, an all-equal group (no signal) and a singleton.
GROUPS = [[1.0, 0.0, 0.5, 0.25], [0.9, 0.9, 0.1, 0.3], [0.7, 0.7, 0.7], [0.4]]
REWARDS = [r for g in GROUPS for r in g]
GROUP_INDEX = [gi for gi, g in enumerate(GROUPS) for _ in g]


# --- the independent reference ----------------------------------------------------------


def ref_grpo(std_normalize: bool) -> list[float]:
    out = []
    for g in GROUPS:
        mean = sum(g) / len(g)
        std = statistics.stdev(g) if len(g) > 1 else 0.0
        out += [(r - mean) / (std + EPS) if std_normalize else r - mean for r in g]
    return out


def ref_rloo() -> list[float]:
    out = []
    for g in GROUPS:
        n = len(g)
        out += [r - (sum(g) - r) / (n - 1) if n > 1 else 0.0 for r in g]
    return out


def ref_reinforce_pp(group_baseline: bool) -> list[float]:
    xs = []
    for g in GROUPS:
        mean = sum(g) / len(g)
        xs += [r - mean if group_baseline else r for r in g]
    mean, std = statistics.fmean(xs), statistics.stdev(xs)
    return [(x - mean) / (std + EPS) for x in xs]


def ref_token_loss(lp, prox, behav, adv, *, decoupled, tis, cap, clip_lo, clip_hi, kl_coef=0.0, ref=None):
    """PPO-clip (Schulman 2017) with decoupled proximal policy (Hilton 2022) and truncated IS."""
    base = prox if decoupled else behav
    ratio = math.exp(lp - base)
    clipped_ratio = min(max(ratio, 1 - clip_lo), 1 + clip_hi)
    pg = max(-adv * ratio, -adv * clipped_ratio)
    w = min(math.exp(prox - behav), cap) if (decoupled and tis) else 1.0
    loss = w * pg
    if kl_coef:
        d = ref - lp
        loss += kl_coef * (math.exp(d) - d - 1)
    return loss, clipped_ratio != ratio and -adv * clipped_ratio > -adv * ratio


def ref_loss(batch, aggregation, **kw) -> tuple[float, float]:
    rows = []
    clipped = total = 0
    for b in range(len(batch["mask"])):
        row = []
        for t in range(len(batch["mask"][b])):
            if batch["mask"][b][t]:
                ref = batch["ref"][b][t] if "ref" in batch else None
                loss, c = ref_token_loss(batch["lp"][b][t], batch["prox"][b][t], batch["behav"][b][t],
                                         batch["adv"][b], ref=ref, **kw)
                row.append(loss)
                clipped += c
                total += 1
        rows.append(row)
    if aggregation == "token-mean":
        value = sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    else:
        seqs = [sum(r) / len(r) for r in rows if r]
        value = sum(seqs) / len(seqs)
    return value, clipped / total


@pytest.fixture(scope="module")
def batch():
    rng = random.Random(7)
    B, T = 4, 9
    lengths = [9, 5, 7, 3]
    mask = [[1 if 1 <= t < lengths[b] and rng.random() < 0.8 else 0 for t in range(T)] for b in range(B)]
    mask[3] = [0] * T  # a row with nothing to learn from: ignored by both aggregations
    behav = [[rng.uniform(-4, -0.1) for _ in range(T)] for _ in range(B)]
    prox = [[x + rng.uniform(-1.2, 1.2) for x in row] for row in behav]  # stale tokens: IS weights up to e^1.2
    lp = [[x + rng.uniform(-0.5, 0.5) for x in row] for row in prox]  # some ratios outside [0.8, 1.2]
    ref = [[x + rng.uniform(-0.3, 0.3) for x in row] for row in lp]
    return {"mask": mask, "behav": behav, "prox": prox, "lp": lp, "ref": ref, "adv": [1.3, -0.7, 0.4, 2.0]}


def as_tensors(batch):
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in batch.items()}
    t["lp"].requires_grad_(True)
    return t


# --- advantages --------------------------------------------------------------------------


def adv(**kw) -> list[float]:
    r = torch.tensor(REWARDS)
    g = torch.tensor(GROUP_INDEX)
    return compute_advantages(r, g, AlgoConfig(adv_eps=EPS, **kw)).tolist()


@pytest.mark.parametrize("name, kw, expected", [
    ("grpo", {}, lambda: ref_grpo(True)),
    ("dr_grpo", {"std_normalize": False}, lambda: ref_grpo(False)),
    ("rloo", {"advantage": "rloo"}, ref_rloo),
    ("reinforce_pp", {"advantage": "reinforce_pp"}, lambda: ref_reinforce_pp(False)),
    ("reinforce_pp_baseline", {"advantage": "reinforce_pp", "group_baseline": True}, lambda: ref_reinforce_pp(True)),
])
def test_advantages_match_published_formulas(name, kw, expected):
    assert adv(**kw) == pytest.approx(expected(), abs=1e-5)


def test_registry_and_degenerate_groups():
    assert set(ADVANTAGES) >= {"grpo", "rloo", "reinforce_pp"}
    a = adv()
    assert a[8:12] == [0.0, 0.0, 0.0, 0.0]  # all-equal group and singleton: no signal, not NaN
    assert adv(advantage="rloo")[11] == 0.0
    with pytest.raises(ValueError, match="unknown advantage"):
        AlgoConfig(advantage="ppo-gae")
    with pytest.raises(ValueError, match="unknown aggregation"):
        AlgoConfig(aggregation="token-sum")


# --- policy loss -------------------------------------------------------------------------


CASES = [
    # name, AlgoConfig kwargs
    ("ppo_clip_vs_behaviour", dict(decoupled=False)),
    ("decoupled_no_is", dict(decoupled=True, tis=False)),
    ("decoupled_tis_cap2", dict(decoupled=True, tis=True, tis_cap=2.0)),
    ("decoupled_tis_cap1.5_clip_higher", dict(decoupled=True, tis=True, tis_cap=1.5, clip_high=0.28)),
    ("kl_k3", dict(decoupled=True, tis=True, tis_cap=2.0, kl_coef=0.05)),
]


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean"])
@pytest.mark.parametrize("name, kw", CASES, ids=[c[0] for c in CASES])
def test_policy_loss_matches_reference(batch, aggregation, name, kw):
    cfg = AlgoConfig(aggregation=aggregation, **kw)
    t = as_tensors(batch)
    ref_logp = t["ref"] if cfg.kl_coef else None
    loss, m = policy_loss(t["lp"], t["prox"], t["behav"], t["adv"], t["mask"], cfg, ref_logp=ref_logp)
    expected, clip_frac = ref_loss(batch, aggregation, decoupled=cfg.decoupled, tis=cfg.tis, cap=cfg.tis_cap,
                                   clip_lo=cfg.clip_low, clip_hi=cfg.clip_high, kl_coef=cfg.kl_coef)
    assert float(loss.detach()) == pytest.approx(expected, abs=1e-5)
    assert m["clip_frac"] == pytest.approx(clip_frac, abs=1e-6)
    assert 0 < m["clip_frac"] < 1  # the batch exercises both branches of the clip


def test_policy_loss_gradient_matches_hand_derivation(batch):
    """d loss / d logp_t = w_t * (-A * ratio_t) / N where the unclipped branch is active, else 0."""
    cfg = AlgoConfig(decoupled=True, tis=True, tis_cap=2.0)
    t = as_tensors(batch)
    loss, _ = policy_loss(t["lp"], t["prox"], t["behav"], t["adv"], t["mask"], cfg)
    loss.backward()
    n = sum(map(sum, batch["mask"]))
    for b, row in enumerate(batch["mask"]):
        for i, on in enumerate(row):
            a = batch["adv"][b]
            ratio = math.exp(batch["lp"][b][i] - batch["prox"][b][i])
            w = min(math.exp(batch["prox"][b][i] - batch["behav"][b][i]), 2.0)
            in_range = (a > 0 and ratio < 1.2) or (a < 0 and ratio > 0.8)
            expected = w * -a * ratio / n if (on and in_range) else 0.0
            assert float(t["lp"].grad[b, i]) == pytest.approx(expected, abs=1e-7)


def test_truncated_is_metrics(batch):
    cfg = AlgoConfig(tis_cap=1.5)
    t = as_tensors(batch)
    _, m = policy_loss(t["lp"], t["prox"], t["behav"], t["adv"], t["mask"], cfg)
    ws = [math.exp(p - b) for pr, br, mr in zip(batch["prox"], batch["behav"], batch["mask"])
          for p, b, on in zip(pr, br, mr) if on]
    assert m["is_weight_max"] == pytest.approx(max(ws), abs=1e-6)
    assert m["is_weight_mean"] == pytest.approx(statistics.fmean(min(w, 1.5) for w in ws), abs=1e-6)
    assert m["is_truncated_frac"] == pytest.approx(sum(w > 1.5 for w in ws) / len(ws), abs=1e-6)
    assert m["tokens"] == len(ws)


def test_global_normalisers_split_into_micro_batches(batch):
    """Summing micro-batch losses with the global counts equals the loss of the whole batch."""
    t = as_tensors(batch)
    for mode in ("token-mean", "seq-mean"):
        cfg = AlgoConfig(aggregation=mode)
        whole, _ = policy_loss(t["lp"], t["prox"], t["behav"], t["adv"], t["mask"], cfg)
        n_tok, n_seq = float(t["mask"].sum()), float((t["mask"].sum(-1) > 0).sum())
        parts = [policy_loss(t["lp"][s], t["prox"][s], t["behav"][s], t["adv"][s], t["mask"][s], cfg,
                             num_tokens=n_tok, num_seqs=n_seq)[0] for s in (slice(0, 1), slice(1, 4))]
        assert float(sum(parts).detach()) == pytest.approx(float(whole.detach()), abs=1e-9)


def test_token_mean_and_seq_mean_differ_as_defined():
    per_token = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    assert float(aggregate(per_token, mask, "token-mean")) == pytest.approx(8 / 5)
    assert float(aggregate(per_token, mask, "seq-mean")) == pytest.approx((1 + 4) / 2)


def test_k3_is_nonnegative_and_zero_at_equality():
    lp = torch.linspace(-3, -0.1, 20)
    assert torch.all(k3_kl(lp, lp) == 0)
    assert torch.all(k3_kl(lp, lp.flip(0)) >= 0)


def test_entropy_bonus_lowers_loss(batch):
    t = as_tensors(batch)
    ent = torch.full_like(t["lp"], 2.0)
    base, _ = policy_loss(t["lp"], t["prox"], t["behav"], t["adv"], t["mask"], AlgoConfig(), entropy=ent)
    bonus, m = policy_loss(t["lp"], t["prox"], t["behav"], t["adv"], t["mask"], AlgoConfig(entropy_coef=0.01),
                           entropy=ent)
    assert float((base - bonus).detach()) == pytest.approx(0.02, abs=1e-9)
    assert m["entropy"] == pytest.approx(2.0)


def test_merge_metrics_weights_by_tokens():
    merged = merge_metrics([{"tokens": 1.0, "clip_frac": 1.0, "is_weight_max": 3.0},
                            {"tokens": 3.0, "clip_frac": 0.0, "is_weight_max": 1.0}])
    assert merged == {"tokens": 4.0, "clip_frac": 0.25, "is_weight_max": 3.0}
