"""From completed trajectories to padded micro-batches: pure, no I/O, no model.

Owns:
- group completeness: `GroupCollector` holds `TrajectoryCompleted` messages until
  a GRPO group reaches its expected size, and hands out whole groups in arrival
  order, N at a time (one global batch = one optimizer step);
- the global batch: per-trajectory advantages (via `algorithms`) broadcast to
  every sample of the trajectory, then a token-balanced shard per data-parallel
  rank;
- micro-batches under a token budget: right-padded `input_ids`/`attention_mask`
  with targets, loss mask, behaviour logprobs and versions shifted for
  next-token prediction; with multi-LoRA (`role_micro_batches`) each micro-batch holds
  one role's rows and names that role's adapter.

Shift convention: a sample of L tokens becomes L-1 positions. Position t feeds
token t and predicts token t+1, so `targets[t] = token_ids[t+1]` and the loss
mask, behaviour logprob and version of position t are those of token t+1. The
first token of a sample is context by definition and must not be in the loss.

It does not know DeepSpeed, NATS or what a trajectory id means beyond a string.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.trainer.algorithms import AlgoConfig, advantage_metrics, compute_advantages
from shared.adapters import role_of
from shared.messages.trajectory import Sample, TrajectoryCompleted

Group = list[TrajectoryCompleted]


def trajectory_id(traj: TrajectoryCompleted) -> str:
    """The exactly-once key of a trajectory: its session id (one completion per session)."""
    return traj.session_id


class GroupCollector:
    """Buffers trajectories by group_id until each group has `group_size` members.

    Duplicates (same trajectory id, e.g. a JetStream redelivery) are ignored and
    reported as such. Complete groups queue in the order they completed.
    """

    def __init__(self, group_size: int):
        if group_size < 1:
            raise ValueError("group_size must be >= 1")
        self.group_size = group_size
        self._open: dict[str, dict[str, TrajectoryCompleted]] = {}
        self._ready: list[Group] = []

    def add(self, traj: TrajectoryCompleted) -> bool:
        """Add one trajectory; False if it was already buffered (a duplicate)."""
        members = self._open.setdefault(traj.group_id, {})
        tid = trajectory_id(traj)
        if tid in members:
            return False
        members[tid] = traj
        if len(members) >= self.group_size:
            self._ready.append(list(self._open.pop(traj.group_id).values()))
        return True

    def ready_groups(self) -> int:
        return len(self._ready)

    def take(self, n: int) -> list[Group] | None:
        """The next `n` complete groups, or None while fewer are ready."""
        if len(self._ready) < n:
            return None
        out, self._ready = self._ready[:n], self._ready[n:]
        return out

    def pending(self) -> dict[str, int]:
        """Incomplete groups and how many members each has so far."""
        return {gid: len(m) for gid, m in self._open.items()}

    def evict(self, group_id: str) -> Group:
        """Give up on an incomplete group (e.g. a rollout failed); returns its members."""
        return list(self._open.pop(group_id, {}).values())


@dataclass(frozen=True)
class Row:
    """One sample of the global batch with its trajectory's advantage."""

    sample: Sample
    advantage: float
    traj: int  # index of the trajectory in the global batch
    role: str = ""  # the agent role its session named (multi-LoRA: which adapter it trains)

    @property
    def length(self) -> int:
        return len(self.sample.token_ids) - 1  # positions after the shift


@dataclass
class GlobalBatch:
    rows: list[Row]
    trajectory_ids: list[str]
    metrics: dict[str, float]


def build_global_batch(groups: list[Group], cfg: AlgoConfig) -> GlobalBatch:
    """Advantages over the whole global batch (REINFORCE++ whitens across all of it). With
    `cfg.drop_uniform_groups` (dynamic sampling), groups whose rewards are all equal leave the
    batch (unless every group is uniform); their trajectory ids stay in `trajectory_ids` (they
    were consumed) and their count is the `groups_dropped` metric."""
    consumed = [trajectory_id(t) for g in groups for t in g]
    total = len(groups)
    if cfg.drop_uniform_groups:
        groups = [g for g in groups if len({t.reward for t in g}) > 1] or groups
    trajs = [t for g in groups for t in g]
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float64)
    group_index = torch.tensor([gi for gi, g in enumerate(groups) for _ in g], dtype=torch.long)
    adv = compute_advantages(rewards, group_index, cfg)
    rows = []
    for i, (traj, a) in enumerate(zip(trajs, adv.tolist())):
        role = role_of(traj.metadata)
        for s in traj.samples:
            validate_sample(s)
            rows.append(Row(s, a, i, role))
    metrics = advantage_metrics(rewards, adv)
    metrics.update(groups=float(len(groups)), trajectories=float(len(trajs)), samples=float(len(rows)),
                   groups_dropped=float(total - len(groups)))
    return GlobalBatch(rows, consumed, metrics)


def validate_sample(s: Sample) -> None:
    n = len(s.token_ids)
    if not (len(s.loss_mask) == len(s.logprobs) == len(s.versions) == n):
        raise ValueError(f"sample lists differ in length: {n} tokens, {len(s.loss_mask)} mask, "
                         f"{len(s.logprobs)} logprobs, {len(s.versions)} versions")
    if n < 2:
        raise ValueError("a sample needs at least 2 tokens (context + one predicted token)")
    if s.loss_mask[0]:
        raise ValueError("the first token of a sample cannot be generated (loss_mask[0] must be 0)")


def shard_rows(rows: list[Row], rank: int, world: int) -> list[Row]:
    """Deterministic token-balanced split for data parallelism: longest first, to the lightest rank."""
    if world == 1:
        return list(rows)
    load = [0] * world
    owned: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(rows)), key=lambda i: (-rows[i].length, i)):
        r = min(range(world), key=lambda r: (load[r], r))
        load[r] += rows[i].length
        owned[r].append(i)
    return [rows[i] for i in sorted(owned[rank])]


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, T] long, right-padded with pad_id
    attention_mask: torch.Tensor  # [B, T] long
    targets: torch.Tensor  # [B, T] long: the token each position predicts
    loss_mask: torch.Tensor  # [B, T] float, 1 where the target was generated by the policy
    behav_logprobs: torch.Tensor  # [B, T] float
    versions: torch.Tensor  # [B, T] long, -1 where not generated
    advantages: torch.Tensor  # [B] float
    adapter: str = ""  # multi-LoRA: the role whose adapter these rows train ("" = the one adapter)

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def num_seqs(self) -> int:
        return int((self.loss_mask.sum(-1) > 0).sum())

    def to(self, device) -> "MicroBatch":
        return MicroBatch(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(self).items()})


def collate(rows: list[Row], pad_id: int, adapter: str = "") -> MicroBatch:
    T = max(r.length for r in rows)
    B = len(rows)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    targets = torch.full((B, T), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((B, T), dtype=torch.float32)
    behav = torch.zeros((B, T), dtype=torch.float32)
    versions = torch.full((B, T), -1, dtype=torch.long)
    for b, r in enumerate(rows):
        s, n = r.sample, r.length
        input_ids[b, :n] = torch.tensor(s.token_ids[:-1])
        attention_mask[b, :n] = 1
        targets[b, :n] = torch.tensor(s.token_ids[1:])
        loss_mask[b, :n] = torch.tensor(s.loss_mask[1:], dtype=torch.float32)
        behav[b, :n] = torch.tensor(s.logprobs[1:], dtype=torch.float32)
        versions[b, :n] = torch.tensor(s.versions[1:])
    behav = behav * loss_mask  # the contract says 0.0 off-mask; make it so even if it was not
    adv = torch.tensor([r.advantage for r in rows], dtype=torch.float32)
    return MicroBatch(input_ids, attention_mask, targets, loss_mask, behav, versions, adv, adapter)


def micro_batches(rows: list[Row], max_tokens: int, pad_id: int, adapter: str = "") -> list[MicroBatch]:
    """Pack rows into right-padded micro-batches of at most `max_tokens` padded positions.

    Rows are taken longest first, so each batch's padding is small; a row longer
    than the budget gets a micro-batch of its own rather than being truncated.
    """
    order = sorted(range(len(rows)), key=lambda i: (-rows[i].length, i))
    out: list[list[Row]] = []
    cur: list[Row] = []
    for i in order:
        row = rows[i]
        width = cur[0].length if cur else row.length  # longest first: the first row sets the width
        if cur and (len(cur) + 1) * width > max_tokens:
            out.append(cur)
            cur = []
        cur.append(row)
    if cur:
        out.append(cur)
    return [collate(b, pad_id, adapter) for b in out]


def role_micro_batches(rows: list[Row], max_tokens: int, pad_id: int,
                       roles: tuple[str, ...]) -> list[MicroBatch]:
    """Multi-LoRA: each role's rows in micro-batches of their own, named for its adapter, roles in
    `roles` order. A row whose role is not in `roles` is a ValueError (the intake keeps them out)."""
    if stray := sorted({r.role for r in rows} - set(roles)):
        raise ValueError(f"rows of roles {stray} have no adapter (roles: {', '.join(roles)})")
    return [mb for role in roles for mb in micro_batches([r for r in rows if r.role == role], max_tokens,
                                                         pad_id, role)]


def role_counts(rows: list[Row]) -> dict[str, float]:
    """Samples and loss tokens per role in the global batch, as step metrics (`role_tokens_<role>`)."""
    out: dict[str, float] = {}
    for r in rows:
        if r.role:
            out[f"role_samples_{r.role}"] = out.get(f"role_samples_{r.role}", 0.0) + 1
            out[f"role_tokens_{r.role}"] = out.get(f"role_tokens_{r.role}", 0.0) + sum(r.sample.loss_mask[1:])
    return out


def empty_micro_batch(pad_id: int) -> MicroBatch:
    """A one-position batch with nothing in the loss: lets a rank with less data keep collectives in step."""
    row = Row(Sample([pad_id, pad_id], [0, 0], [0.0, 0.0], [-1, -1]), 0.0, -1)
    return collate([row], pad_id)
