"""A SIMULATED cluster in virtual time, driven by the scheduler's real policy module.

    from services.scheduler.sim import Cluster, simulate
    r = simulate(Cluster.uniform(16, train_hosts=4), CALIBRATIONS["decode-heavy"],
                 WORKLOADS["long-tail"], policy="seamless", steps=50)
    print(r.trained_tokens_per_s, r.idle_fraction)

No model runs here: hosts generate and train tokens at a calibrated speed
(workload.Calibration), for benchmarks and capacity planning only.

What it owns: virtual time, the hosts' running sequences, the trainer's state machine and
the bookkeeping (result.Result). What it borrows, never copies:
- placement: services/scheduler/policy.py `decide`, `apply`, `gate_open`, `lend_verdict`
  and `activity` (host timelines) are called as the live scheduler calls them: `decide` on
  every tick, as its control loop does (at 4,096 hosts x 1,000 steps this costs a few seconds;
  asking it only when its own inputs changed once missed lends the verdict allowed);
- which turns a lent host takes: shared/lending.py `takes_turn` (through `lent_offer`), the
  live router's rule, with its length predictor (`LengthHistory`) and its speed model
  (`DecodeSpeed`, here the calibration's a + b*k at the lent host's batch with the turn added);
  the work on offer to hosts not yet lent goes to the lend verdict as `Snapshot.offer`;
- the staleness bound: shared/admission.py `Admission`, as the trajectory manager applies it
  on every session it creates (with `Options.backlog` "heartbeat", on the backlog as the trajectory
  manager reads it: the trainer's holdings as of its last TrainerStatus).

Model, in order of one tick (steps numbered in `_tick`):
- Time advances in ticks of at most `dt` (the scheduler's control tick); a tick also ends
  at every control event (a switch finishing, the trainer finishing compute or publish).
- A rolling host decodes every running sequence one token per step of
  `a + b*k` seconds (k running, up to K), after paying its pending prefill and weight loads
  (`Calibration.weight_load_s` per published version, the trainer's weight_sync_s unless set).
  With `Calibration.prefill_one_step` (services/rollout/simulated.py, the live runs' stand-in
  engine) a turn's prefill is instead one step of its own before its first token, whatever its
  context, and the host's other sequences decode on meanwhile.
  Within a tick k is constant; a slot freed mid-tick is refilled with the time it was free
  credited, so a saturated host loses nothing to the tick.
- Sessions: admitted by `Admission`, then queued, dispatched to free slots (a lent host
  only takes the turns `Options.lent_rule` gives it: "fit", predicted to finish before its
  `lent_until`; "migrate", worth their re-prefill), decoded, then either a tool call (slot freed for `tool_latency_s`) or done. A group is complete when all its
  sessions are; the trainer takes `groups_per_step` complete groups per step.
- The trainer: its batch's tokens x `train_s_per_token`, then `weight_sync_s` of publish, at the
  end of which the version is out. `Calibration.bookkeeping_s` keeps it publishing that much
  longer (the live trainer's audit record, checkpoints, metrics and status). Each compute starts
  `Calibration.gate_s` after its gate opens (the gate's round trip; the train host idle), then
  takes `Calibration.start_s` more (the hand-off to the runner; the trainer computing). All 0 by
  default.
- A reclaimed host vacates: its sequences keep their tokens, re-queue, and pay a prefill of
  their whole context where they land (counted as re-prefilled). Colocated holds instead.
  With `reclaim_grace_s` the policy first drains a lent host (its `lent_until` becomes now,
  so it takes no new turn) and reclaims it once it runs nothing or the grace is over;
  `drain_margin_s` moves `lent_until` earlier (policy.py says how).
- `replicas` = w > 1 makes each simulated session stand for w identical ones (w x the
  tokens, w x the slots it occupies), so 4,096 hosts x 1,000 steps fit in a minute; the
  length tail is then drawn w times more coarsely. w = 1 is exact.
- `host_group` = m > 1 makes each simulated host stand for m identical hosts, evenly loaded,
  that the policy moves together (as it does identical hosts: same tags, same costs, same
  trainer state). The policy then sees n/m hosts. m = 1 is exact.
- The control plane (`Options.control_s_per_turn` > 0): every turn costs that many CPU seconds
  outside the engine (the agent's HTTP calls, the gateway, the trajectory manager, the
  worker's streamed deltas, NATS and Redis), on `control_cores` cores shared by all turns. A
  turn becomes dispatchable only once a FIFO server of that capacity has done its work: at
  least `control_s_per_turn` after it is queued, and at most `control_cores /
  control_s_per_turn` turns per second. 0 (the default) leaves it out.
- Latency outside the engine (`Options.turn_latency_s` > 0): every turn takes that many
  seconds of wall time outside the engine (the agent's HTTP calls, the gateway, the trajectory
  manager's Redis and NATS round trips, the streamed deltas), spent waiting, not computing: a
  queued turn becomes dispatchable that long after it is queued (its session stays open
  meanwhile, so admission counts it), whatever the load. It is a measured input
  (bench/pipeline_live.py measures it as the agents' time per turn less the engine's own).
  With the control plane as well, a turn waits for the later of the two. 0 (the default)
  leaves it out.
- Latency after the engine (`Options.turn_latency_after_s` > 0): the part of a turn's wall
  time outside the engine that comes after its last token (the reply streamed back to the
  agent, and on a session's last turn its /finish call). The slot is still freed when the
  engine is done; the session moves on only that much later: a tool call starts then (its
  `tool_latency_s` after it), and a last turn's session completes then (state FINISHING: still
  open for admission, its group not complete, not yet available to the trainer), at the end
  of the tick it falls in, as a tool's return is seen. `turn_latency_s` is then the part
  before the engine. 0 (the default) leaves it out. `Options.turn_latency_cv` > 0 draws both,
  turn by turn, around those means (a gamma of that coefficient of variation, from a random
  stream of its own); 0 keeps every turn at the mean, which holds sessions admitted together
  in step for the whole run.
- Routing (`Options.route`): by default a queued turn takes a slot freed this tick first, so
  a host that finishes turns gets the next ones; "least_loaded" routes each turn to the host
  with the fewest running sequences per capacity, as the live trajectory manager does. With
  fixed-length turns the two differ: refilling keeps hosts unevenly loaded.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from services.scheduler import policy as P
from services.scheduler.sim.result import Result, Totals
from services.scheduler.sim.workload import Calibration, Workload
from shared.admission import Admission, Backlog
from shared.lending import (DEFAULT_RULE, REBALANCE, DecodeSpeed, LendHistory, LengthHistory, Move, Offer,
                            lent_offer, level, move_worth, rebalanced)

MODES = ("idle", "rollout", "train")  # array codes 0, 1, 2
_MODE = {m: i for i, m in enumerate(MODES)}
ACTS = ("train", "rollout", "switch", "idle")
FREE, QUEUED, RUNNING, TOOL, FINISHING = 0, 1, 2, 3, 4
STATUS_INTERVAL_S = 1.0  # the live trainer's TrainerStatus heartbeat (services/trainer/service.py STATUS_INTERVAL)


@dataclass(frozen=True)
class Cluster:
    """Hosts by id order: tags and capacity weights; `train_hosts` = the train pool size."""

    tags: tuple[frozenset[str], ...]
    capacity: tuple[float, ...]
    train_hosts: int

    @classmethod
    def uniform(cls, n: int, train_hosts: int, pool_only_train: bool = False) -> Cluster:
        """n hosts, all tagged {train, rollout} (a host outside the pool may still be lent
        nothing: lending is of pool hosts); with pool_only_train, hosts past the pool are
        {rollout} only."""
        both, roll = frozenset({"train", "rollout", "gpu"}), frozenset({"rollout", "gpu"})
        tags = tuple(both if (i < train_hosts or not pool_only_train) else roll for i in range(n))
        return cls(tags, (1.0,) * n, train_hosts)

    @property
    def n(self) -> int:
        return len(self.tags)


@dataclass
class Options:
    steps: int = 50
    seed: int = 0
    dt: float = 0.25  # scheduler tick (s): control decisions and dispatch happen on ticks
    lend_margin: float = 1.5
    drain_margin_s: float = 0.0  # policy.Snapshot.drain_margin_s
    reclaim_grace_s: float = 0.0  # policy.Snapshot.reclaim_grace_s
    lend_settle_s: float = 30.0  # policy.Snapshot.lend_settle_s (read only with a grace)
    rate_tau_s: float = 20.0  # completion-rate EWMA time constant, as the scheduler measures it
    replicas: int = 1
    host_group: int = 1  # m > 1: each simulated host stands for m identical hosts that move together
    timeline: bool = False  # record every host's activity intervals (for Gantt charts)
    max_time_s: float = math.inf
    progress: object = None  # callable(steps_done) or None
    # what admission counts as the backlog: "untrained" (every completed session not trained yet);
    # "heartbeat", the live trajectory manager's count since session 19 as it reads it (the consumer's
    # pending, now, plus what the trainer's newest TrainerStatus says it holds: its complete groups and the
    # batch in hand, shared/admission.py `held_by_trainer`; the trainer fetches at once until 2 x
    # groups_per_step complete groups wait, so the finished members of incomplete groups, and groups
    # completed since its last status, count for nothing); or "undelivered", the live count before
    # session 19 (the consumer's pending only, the fetched samples and the batch in training not counted)
    backlog: str = "untrained"
    # CPU seconds a turn costs outside the engine (0: not modelled), and the cores that work shares
    control_s_per_turn: float = 0.0
    control_cores: float = 1.0
    # wall seconds a turn spends outside the engine, waiting (0: not modelled): a measured input
    turn_latency_s: float = 0.0
    # wall seconds of it after the engine (the reply back, /finish): delays the session, not the slot
    turn_latency_after_s: float = 0.0
    # the spread of both latencies from turn to turn: each turn's drawn from a gamma distribution of that
    # mean and this coefficient of variation (std / mean; bench/pipeline_live.py measures it). 0: every turn
    # the mean, which keeps sessions admitted together in step with each other for the whole run
    turn_latency_cv: float = 0.0
    # where a queued turn goes: "refill" (slots freed this tick first, then the others by rank;
    # fast, the default) or "least_loaded", as the live trajectory manager routes (per turn)
    route: str = "refill"
    # which turns a lent host takes (shared/lending.py, the live router's rule): "fit" (only turns
    # predicted to end before its reclaim) or "migrate" (any turn worth its re-prefill)
    lent_rule: str = DEFAULT_RULE
    # a re-prefilled token against a token decoded at full batch; None: the calibration's own
    # (prefill_s_per_token / (step(K) / K))
    reprefill_ratio: float | None = None
    # pass the work on offer (policy.Snapshot.offer) to the lend verdict: a lend must buy rollout. The
    # live scheduler does so only with SF_SCHEDULER_LIVE_OFFER (off by default): a live comparison passes
    # what the live scheduler ran (bench/pipeline_live.py), else a lend the live run made is never made here
    offer: bool = True
    renew_s: float = 0.0  # policy.Snapshot.renew_s (the live scheduler's SF_SCHEDULER_RENEW_S, 2 s by default)
    # a host that begins rolling out (a lend) takes its share of the busier hosts' running turns, which move
    # with their partial tokens (prefilled again): the live router's SF_TRAJECTORY_REBALANCE, shared/lending.py
    # `rebalanced`. Off by default (the planning runs predate it)
    rebalance: bool = False
    # with rebalance: move a running turn only where shared/lending.py `move_worth` says it saves more time
    # than its re-prefill costs (the live router's SF_TRAJECTORY_REBALANCE_WORTH); False: the first
    # `rebalanced` of them, youngest first, as before
    rebalance_worth: bool = True


def host_id(i: int) -> str:
    return f"h{i:05d}"


class Simulator:
    def __init__(self, cluster: Cluster, cal: Calibration, wl: Workload, policy: str, opt: Options):
        self.cl, self.cal, self.wl, self.policy, self.opt = cluster, cal, wl, policy, opt
        w = opt.replicas
        if wl.groups_per_step % w:
            raise ValueError(f"replicas {w} must divide groups_per_step {wl.groups_per_step}")
        self.w = w
        self.rng = np.random.default_rng(opt.seed)
        self.adm = Admission(wl.max_staleness)
        self.B = wl.batch_samples  # real samples per version
        m = self.m = opt.host_group
        if cluster.n % m or cluster.train_hosts % m:
            raise ValueError(f"host_group {m} must divide the hosts ({cluster.n}) and the pool ({cluster.train_hosts})")
        for g in range(0, cluster.n, m):
            if len({(cluster.tags[i], cluster.capacity[i]) for i in range(g, g + m)}) != 1:
                raise ValueError(f"host_group {m}: hosts {g}..{g + m - 1} differ in tags or capacity")
        cluster = Cluster(cluster.tags[::m], cluster.capacity[::m], cluster.train_hosts // m)
        self.K = max(1, cal.max_seqs * m // w)  # slots per simulated host, in simulated sessions
        self.train_hosts = 0 if policy == "colocated" else cluster.train_hosts
        self._init_hosts(cluster)
        self._init_sessions()
        self._init_trainer(cluster.n)

    def _init_hosts(self, cluster: Cluster) -> None:
        """Each simulated host's state (a host group counts as one)."""
        n = cluster.n
        self.cap = np.asarray(cluster.capacity, dtype=float)
        self.mode = np.zeros(n, np.int8)
        self.target = np.zeros(n, np.int8)
        self.switch_end = np.full(n, math.inf)
        self.stall = np.zeros(n)  # seconds of prefill / weight load a host owes before decoding
        self.hversion = np.zeros(n, np.int64)
        self.lent_until = np.zeros(n)
        self.rolled_since = np.zeros(n)  # when each host last began rolling out
        self.lends_measured = LendHistory()  # how long lends of pool hosts lasted (the rebalance worth test)
        self.k_run = np.zeros(n, np.int64)  # running sequences per host, kept as they start and stop
        self.hosts = [P.Host(host_id(i), cluster.tags[i], cluster.capacity[i]) for i in range(n)]
        self.index = {h.id: i for i, h in enumerate(self.hosts)}

    def _init_sessions(self) -> None:
        """Sessions (a fixed pool; admission bounds how many are open) and their groups."""
        w, wl = self.w, self.wl
        cap_real = self.adm.capacity(self.B) if self.adm.enabled else 4 * self.B
        size = cap_real // w + wl.group_size + 8
        self.s_state = np.zeros(size, np.int8)
        self.s_host = np.full(size, -1, np.int64)
        self.s_rem = np.zeros(size)
        self.s_len = np.zeros(size)  # the current turn's length, drawn (what the length predictor records)
        self.s_turn = np.zeros(size, np.int64)
        self.s_group = np.zeros(size, np.int64)
        self.s_ctx = np.zeros(size)  # context tokens: prompt + generated + tool output
        self.s_gen = np.zeros(size)
        self.s_pf = np.zeros(size)  # tokens to prefill at the next dispatch
        self.s_skip = np.zeros(size)  # decode steps a running turn spends before its first token (prefill_one_step)
        self.s_ready = np.zeros(size)  # queued since / tool returns at / finishes at
        self.s_v0 = np.full(size, -1, np.int64)  # version of the oldest generated token
        self.free_slots = list(range(size - 1, -1, -1))
        # open groups, by slot: sessions left, tokens, generated, sum and min of first-token versions
        self.g_left = np.zeros(size + 2, np.int64)
        self.g_tokens = np.zeros(size + 2)
        self.g_gen = np.zeros(size + 2)
        self.g_v0sum = np.zeros(size + 2)
        self.g_v0min = np.zeros(size + 2, np.int64)
        self.g_free = list(range(size + 1, -1, -1))
        self.cur_group, self.group_fill = -1, 0
        # complete groups the trainer has not taken: (samples, tokens, generated, v0 sum, v0 min)
        self.complete: deque[tuple[int, float, float, float, int]] = deque()

    def _init_trainer(self, n: int) -> None:
        """The trainer, the clock, and what is accounted over the run (n: simulated hosts)."""
        self.t = 0.0
        self.tstate = "waiting"
        self.version = 0
        self.step = 0
        self.tr_end = math.inf  # end of compute, publish or bookkeeping, or (ready) the compute's start
        self.start_at: float | None = None  # ready, gate open: when its answer arrives (Calibration.gate_s)
        self.booking = False  # publishing past the version's publish: the trainer's bookkeeping_s
        self.wants_since = 0.0  # when the trainer last began to want its hosts
        self.waiting_since = 0.0  # when the trainer last began to wait for data (the lend settle)
        self.pool_idx = np.zeros(0, np.int64)  # the train pool's host indices (set by run)
        self.batch: list = []
        self.available = 0  # real samples in complete, untaken groups
        self.untrained = 0  # real completed samples not trained yet (the admission backlog)
        # backlog "heartbeat": what the trainer's last TrainerStatus said it held (sent at each state change
        # and every STATUS_INTERVAL_S), and when the next periodic one is due
        self.status_held = 0
        self.status_next = STATUS_INTERVAL_S
        self.open = 0  # real open sessions
        self.rate = 0.0
        # the live router's length predictor (shared/lending.py): here its window of all recent replies,
        # which is what it reads for a turn whose group has no finished reply yet (every group of one)
        self.lengths = LengthHistory()
        ratio = self.opt.reprefill_ratio
        if ratio is None:
            ratio = self.cal.prefill_s_per_token * self.cal.max_seqs / self.cal.step_s(self.cal.max_seqs)
        self.reprefill_ratio = ratio if self.opt.lent_rule == "migrate" else None
        # a rollout host's in-place load of each published version (Calibration.weight_load_s)
        self.weight_load_s = self.cal.weight_sync_s if self.cal.weight_load_s is None else self.cal.weight_load_s
        self._offer_at: tuple[float, Offer | None] = (-1.0, None)
        self.lat_rng = np.random.default_rng([self.opt.seed, 1])  # its own stream: the lengths drawn stay the same
        self.tot = Totals(n)
        self.act_prev = np.full(n, -1, np.int8)
        self.act_since = np.zeros(n)
        self.act_table: dict[str, np.ndarray] = {}
        self._host_rows = np.arange(n)
        # hosts change only in _decide and _settle_switches; each bumps hosts_rev, which keys
        # the gate's answer and the drain snapshot's hosts (built again only when they change)
        self.hosts_rev = 0
        self._gate: tuple[int, bool] = (-1, False)
        self._drain_hosts: tuple[int, np.ndarray, list[P.Host]] = (-1, np.zeros(0, np.int64), [])
        self.cp_free = 0.0  # when the control plane has done all the turns queued so far

    # -- the policy, called as the live scheduler calls it -----------------------------------

    def snapshot(self) -> P.Snapshot:
        needed = max(0, self.B - self.available) if self.tstate == "waiting" else 0
        hosts = tuple(self._running_hosts() if self._draining() else self.hosts)
        return P.Snapshot(self.policy, self.t, hosts, P.Trainer(self.tstate, needed, self.wants_since,
                                                                 self.waiting_since),
                          self.rate, P.Costs(self.cal.lend_s, self.cal.reclaim_s), self.opt.lend_margin,
                          self.train_hosts, self.opt.drain_margin_s, self.opt.reclaim_grace_s, self.opt.lend_settle_s,
                          self._offer(), self.opt.renew_s)

    def _offer(self) -> Offer | None:
        """The work lent hosts would be given now (policy.Snapshot.offer), in real turns and hosts:
        the queued turns that the serving hosts' free slots do not take, shared by the pool hosts
        not lent yet, at the predicted length and the calibrated speed."""
        if self.policy != "seamless" or not self.opt.offer:
            return None
        at, offer = self._offer_at
        if at == self.t:
            return offer
        q = np.nonzero(self.s_state == QUEUED)[0]
        rolling = (self.mode == 1) & (self.target == 1)
        serving = rolling & (self.lent_until <= 0)
        free = int((self.K - self.k_run[serving]).clip(0).sum())
        turns = max(0, len(q) - free) * self.w
        pool = self.pool_idx
        hosts = int(np.count_nonzero(~rolling[pool])) * self.m
        cap = float(self.cap[pool].mean()) if len(pool) else 1.0
        speed = DecodeSpeed(self.cal.decode_a_s / cap, self.cal.decode_b_s / cap)
        ctx = float(self.s_ctx[q].mean()) if len(q) else float(self.wl.prompt_tokens)
        offer = Offer(turns, hosts, self.lengths.expected(None), speed, self.cal.max_seqs, ctx, self.reprefill_ratio,
                      refill=True)
        self._offer_at = (self.t, offer)
        return offer

    def _running_hosts(self) -> list[P.Host]:
        """self.hosts with `running` filled in (the grace reads how many sequences each host
        runs); only hosts whose count or state changed since the last call are built again."""
        rev, counts, hosts = self._drain_hosts
        if rev != self.hosts_rev:
            counts, hosts = np.full(len(self.hosts), -1, np.int64), list(self.hosts)
        for i in np.nonzero(self.k_run != counts)[0].tolist():
            h = self.hosts[i]
            hosts[i] = P.Host(h.id, h.tags, h.capacity, h.mode, h.target, h.epoch, h.healthy, h.cordoned,
                              int(self.k_run[i]), h.lent_until)
        self._drain_hosts = (self.hosts_rev, self.k_run.copy(), hosts)
        return hosts

    def _gate_open(self) -> bool:
        """policy.gate_open, asked again only when the hosts changed (it reads nothing else
        that moves: their modes, targets and health, and the pool)."""
        if self._gate[0] != self.hosts_rev:
            s = P.Snapshot(self.policy, self.t, tuple(self.hosts), train_hosts=self.train_hosts)
            self._gate = (self.hosts_rev, P.gate_open(s))
        return self._gate[1]

    def _draining(self) -> bool:
        """May the policy be draining lent hosts now (seamless, a grace, the trainer wants its
        hosts, a pool host still rolling out)? Then it decides every tick."""
        if self.opt.reclaim_grace_s <= 0 or self.policy != "seamless" or self.tstate not in P.TRAINER_WANTS_HOSTS:
            return False
        return bool(((self.mode[self.pool_idx] == 1) & (self.target[self.pool_idx] == 1)).any())

    def _decide(self) -> None:
        s = self.snapshot()
        ds = P.decide(s)
        self.tot.decide_calls += 1
        if not ds:
            return
        self.hosts = list(P.apply(s, ds).hosts)
        self.hosts_rev += 1
        vacate = []
        for d in ds:
            i = self.index[d.host]
            old, new = self.mode[i], _MODE[d.mode]
            if old == new == self.target[i]:  # a drain: only lent_until moves, nothing switches
                self.lent_until[i] = d.lent_until
                self.tot.drains += 1
                continue
            self.target[i] = new
            self.switch_end[i] = self.t + (self.cal.lend_s if new == 1 else self.cal.reclaim_s) / self.cap[i]
            # lent_until steers routing only where a reclaim vacates (seamless); colocated holds
            self.lent_until[i] = d.lent_until if self.policy == "seamless" else 0.0
            if old == 1 and new != 1:
                if not d.hold:
                    vacate.append(i)
                if new == 2:
                    self.tot.reclaims += 1
                    self.lends_measured.record(self.t - float(self.rolled_since[i]))
            elif new == 1 and i in self.pool:
                self.tot.lends += 1
        if vacate:
            self._vacate(vacate)

    def _settle_switches(self) -> None:
        done = np.nonzero(self.switch_end <= self.t + 1e-12)[0]
        if not len(done):
            return
        began = []  # hosts that begin rolling out now
        for i in done:
            i = int(i)
            if self.target[i] == 1 and self.mode[i] != 1:
                began.append(i)
                self.rolled_since[i] = self.t
            self.mode[i] = self.target[i]
            self.switch_end[i] = math.inf
            h = self.hosts[i]
            self.hosts[i] = P.Host(h.id, h.tags, h.capacity, MODES[self.mode[i]], MODES[self.target[i]], h.epoch,
                                   lent_until=h.lent_until)
            if self.mode[i] == 1:
                self.hversion[i] = self.version  # a lent host loaded the current version first
        self.hosts_rev += 1
        if self.opt.rebalance and began:
            # turns already waiting for a slot go to the new hosts first (dispatch, this tick): a host they
            # fill takes nothing from the others. Live there is no central queue: the router sends every
            # turn to a worker, the turns beyond its slots wait inside that worker's engine and count in
            # its `busy`, and they are the youngest, moved first (nothing decoded: no re-prefill wasted)
            waiting = int(((self.s_state == QUEUED) & (self.s_ready <= self.t)).sum())
            for i in began:
                takes = min(waiting, max(0, self.K - int(self.k_run[i])))
                waiting -= takes
                self._rebalance(i, takes)

    def _rebalance(self, i: int, queued: int = 0) -> None:
        """Host i has begun rolling out, and will take `queued` turns that wait for a slot: each rolling
        host at its version or newer, more loaded by more than REBALANCE, gives up the turns that even
        the two out (shared/lending.py `rebalanced`), its youngest; they queue again with their context
        to prefill, and routing sends them to i."""
        rolling = (self.mode == 1) & (self.target == 1)
        got = int(self.k_run[i]) + queued
        for j in np.nonzero(rolling)[0].tolist():
            if j == i or self.hversion[j] < self.hversion[i]:
                continue
            k = rebalanced(float(self.k_run[j]), self.K, got, self.K, REBALANCE)
            if k <= 0:
                continue
            on = np.nonzero((self.s_state == RUNNING) & (self.s_host == j))[0]
            on = on[np.argsort(self.s_gen[on], kind="stable")]
            moved = self._worth_moving(i, j, on, k, got) if self.opt.rebalance_worth else on[:k]
            if not len(moved):
                continue
            self._migrate(moved)
            self.k_run[j] -= len(moved)
            got += len(moved)

    def _worth_moving(self, i: int, j: int, on: np.ndarray, k: int, got: int) -> np.ndarray:
        """Of the turns `on` running on host j (youngest first), the first `k` that shared/lending.py's
        `move_worth` says are worth moving to host i (which runs `got`): each at the two hosts'
        batches as the moves before it left them, its remaining length from the live router's
        predictor, its context prefilled again at the calibration's prefill rate."""
        cal, wm = self.cal, self.w / self.m
        window = self.lends_measured.window(self.t, float(self.lent_until[i]), float(self.rolled_since[i]))
        out: list[int] = []
        busy = int(self.k_run[j])
        stall = float(self.stall[i])  # prefill and weight loads host i owes, then each move's re-prefill
        pf = cal.prefill_s_per_token * self.w / (self.cap[i] * self.m)  # a simulated turn's, as _start charges it
        batch = level(busy, self.K, got, self.K) * wm  # host i's, in real sequences, once the two are even
        for s in on.tolist():
            if len(out) >= k:
                break
            ahead = self.lengths.remaining(None, float(self.s_gen[s]))
            if ahead is not None:  # never past the workload's cap on a reply
                ahead = min(ahead, self.wl.length_cap - float(self.s_gen[s]))
            m = Move(ahead, float(self.s_ctx[s]), (cal.decode_a_s + cal.decode_b_s * busy * wm) / self.cap[j],
                     (cal.decode_a_s + cal.decode_b_s * (got + 1) * wm) / self.cap[i], pf,
                     busy_running=round((busy - 1) * wm), lent_batch=batch, lent_stall_s=stall)
            if move_worth(m, window) > 0:
                out.append(s)
                stall += float(self.s_ctx[s]) * pf
                busy -= 1
                got += 1
        return np.array(out, np.int64)

    # -- sessions ----------------------------------------------------------------------------

    def _vacate(self, hosts: list[int]) -> None:
        on = np.nonzero((self.s_state == RUNNING) & np.isin(self.s_host, hosts))[0]
        if not len(on):
            return
        self._migrate(on)
        self.k_run[hosts] = 0

    def _migrate(self, on: np.ndarray) -> None:
        """Running sessions `on` leave their host with their partial tokens: they queue again, and the
        whole context is prefilled again where they land (the caller frees their hosts' slots)."""
        self.s_state[on] = QUEUED
        self.s_host[on] = -1
        self.s_ready[on] = self.t
        self.s_pf[on] = self.s_ctx[on]
        self.s_skip[on] = 0.0  # its prefill's step is paid again where it lands
        self.tot.reprefilled += float(self.s_ctx[on].sum()) * self.w
        self.tot.migrated += len(on) * self.w

    def _admit(self) -> None:
        """Open as many sessions as `Admission.admit` allows, one simulated session (w real
        ones) at a time; admit() is monotone in the open count, so bisect instead of looping."""
        wl, w = self.wl, self.w
        backlog = Backlog(self._backlog(), self.B)
        if not self.free_slots or not self.adm.admit(self.open, backlog):
            return
        lo, hi = 0, len(self.free_slots)  # admit() holds before each of the first n sessions
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.adm.admit(self.open + (mid - 1) * w, backlog):
                lo = mid
            else:
                hi = mid - 1
        n = lo
        if n == 0:
            return
        js = np.array(self.free_slots[-n:][::-1], np.int64)
        del self.free_slots[-n:]
        gs, i = wl.group_size, 0
        while i < n:  # sessions fill groups in order; a group's slot is taken at its first session
            if self.group_fill == 0:
                g = self.cur_group = self.g_free.pop()
                self.g_left[g], self.g_tokens[g], self.g_gen[g], self.g_v0sum[g] = gs, 0.0, 0.0, 0.0
                self.g_v0min[g] = 2**62
            take = min(gs - self.group_fill, n - i)
            self.s_group[js[i:i + take]] = self.cur_group
            i += take
            self.group_fill = (self.group_fill + take) % gs
        self.s_state[js] = QUEUED
        self.s_turn[js] = 0
        self.s_rem[js] = self.s_len[js] = wl.draw(self.rng, n)
        self.s_ctx[js] = wl.prompt_tokens
        self.s_pf[js] = wl.prompt_tokens
        self.s_gen[js] = 0.0
        self.s_v0[js] = -1
        self.s_ready[js] = self.t
        self._control(js)
        self.open += n * w

    def _backlog(self) -> int:
        """Completed sessions admission counts as not trained yet (Options.backlog)."""
        if self.opt.backlog == "untrained":
            return self.untrained
        if self.opt.backlog == "heartbeat":
            return self.status_held + self._undelivered()
        return max(0, self.available - 2 * self.B)

    def _dispatch(self, t0: float, freed_h: np.ndarray, freed_t: np.ndarray) -> None:
        q = np.nonzero(self.s_state == QUEUED)[0]
        if self.opt.control_s_per_turn > 0 or self.opt.turn_latency_s > 0:  # not through the control plane yet
            q = q[self.s_ready[q] <= self.t]
        if not len(q):
            return
        running = self.k_run.copy()
        free = self._free(running, q)
        total = int(free.sum())
        if total <= 0:
            return
        sh, st, sr = self._slots(t0, free, freed_h, freed_t)
        if self.opt.route == "least_loaded":
            order = self._least_loaded(sh, st, running, min(total, len(q)))
        else:
            order = np.lexsort((sh, sr, st))[: min(total, len(q))]
        sh, st = sh[order], st[order]
        q = q[np.argsort(self.s_ready[q], kind="stable")][: len(sh)]
        self._start(q, sh, st, running)

    def _free(self, running: np.ndarray, q: np.ndarray) -> np.ndarray:
        """Free slots per host: on rolling hosts, and on a lent one only for turns predicted to end
        before its reclaim."""
        rolling = (self.mode == 1) & (self.target == 1)
        free = np.where(rolling, self.K - running, 0)
        lent = rolling & (self.lent_until > 0) & (free > 0)
        if lent.any():  # a lent host offers the slots whose turn the live router's rule gives it
            free = self._lent_free(free, lent, float(self.s_ctx[q].mean()))
        return free

    def _slots(self, t0: float, free: np.ndarray, freed_h: np.ndarray,
               freed_t: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The free slots as (host, free since, rank on its host): those freed this tick (their
        free time) first, then ones free since t0; a host offers no more than `free` in all (a
        lent host's offer may be fewer than it freed)."""
        n = len(self.mode)
        if len(freed_h):
            o = np.lexsort((freed_t, freed_h))
            freed_h, freed_t = freed_h[o], freed_t[o]
            keep = np.arange(len(freed_h)) - np.searchsorted(freed_h, freed_h) < free[freed_h]
            freed_h, freed_t = freed_h[keep], freed_t[keep]
        extra = np.bincount(freed_h, minlength=n) if len(freed_h) else np.zeros(n, np.int64)
        pre = np.maximum(free - extra, 0)
        hosts = np.nonzero(pre)[0]
        cnt = pre[hosts]
        ph = np.repeat(hosts, cnt)
        rank = np.arange(len(ph)) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        sh = np.concatenate([freed_h, ph])
        st = np.concatenate([freed_t, np.full(len(ph), t0)])
        sr = np.concatenate([np.zeros(len(freed_h)), rank])
        return sh, st, sr

    def _start(self, q: np.ndarray, sh: np.ndarray, st: np.ndarray, running: np.ndarray) -> None:
        """Start the queued sessions q on the slots (host sh, free since st); `running`: each
        host's running sequences before this tick's starts."""
        n = len(self.mode)
        self.s_state[q] = RUNNING
        self.s_host[q] = sh
        self.k_run += np.bincount(sh, minlength=n)
        if self.cal.prefill_one_step:  # the stand-in engine: one step of the turn's own, the others decode on
            self.s_skip[q] = 1.0
        else:
            pf_s = self.s_pf[q] * self.cal.prefill_s_per_token * self.w / (self.cap[sh] * self.m)
            np.add.at(self.stall, sh, pf_s)
        self.tot.prefilled += float(self.s_pf[q].sum()) * self.w
        self.s_pf[q] = 0.0
        # credit the time the slot and the session were both free before this tick's end
        credit = np.maximum(0.0, self.t - np.maximum(st, self.s_ready[q]))
        if credit.any():
            k = np.bincount(sh, minlength=n)[sh] + running[sh]
            step = (self.cal.decode_a_s + self.cal.decode_b_s * k * self.w / self.m) / self.cap[sh]
            adv = np.minimum(credit / step, self.s_rem[q] + self.s_skip[q] - 1e-9)
            adv = np.maximum(adv, 0.0)
            self._decode(q, sh, adv)

    def _lent_free(self, free: np.ndarray, lent: np.ndarray, context: float) -> np.ndarray:
        """`free` with each lent host's free slots cut to those shared/lending.py's `lent_offer` gives
        turns: at the host's own speed (capacity, host group and replicas in), at the batch each
        slot makes."""
        free = free.copy()
        expected = self.lengths.expected(None)
        a, b = self.cal.decode_a_s, self.cal.decode_b_s * self.w / self.m  # per simulated sequence
        for i in np.nonzero(lent)[0].tolist():
            speed = DecodeSpeed(a / self.cap[i], b / self.cap[i])
            o = Offer(0, 1, expected, speed, self.K, context, self.reprefill_ratio)
            free[i] = lent_offer(o, self.t, float(self.lent_until[i]), int(self.k_run[i]), int(free[i]))
        return free

    def _least_loaded(self, sh: np.ndarray, st: np.ndarray, running: np.ndarray, want: int) -> np.ndarray:
        """Which of the free slots (host sh, free since st) `want` queued turns take, routed as
        the live trajectory manager routes a new turn (services/trajectory/routing.py): to the
        least loaded host (running / capacity), the earliest free slot there."""
        by_host: dict[int, list[int]] = {}
        for j in np.lexsort((st, sh)).tolist():
            by_host.setdefault(int(sh[j]), []).append(j)
        load = {h: float(running[h]) / self.cap[h] for h in by_host}
        out = []
        for _ in range(want):
            h = min(load, key=lambda x: (load[x], x))
            out.append(by_host[h].pop(0))
            load[h] += 1.0 / self.cap[h]
            if not by_host[h]:
                del load[h]
        return np.array(out, np.int64)

    def _decode(self, idx: np.ndarray, hosts: np.ndarray, steps: np.ndarray) -> None:
        """Running turns `idx` (on `hosts`) advance `steps` decode steps each: their prefill's step first
        (Calibration.prefill_one_step), then a token a step."""
        if self.cal.prefill_one_step:
            skip = np.minimum(steps, self.s_skip[idx])
            if skip.any():
                self.s_skip[idx] -= skip
                steps = steps - skip
        self._generate(idx, hosts, steps)

    def _generate(self, idx: np.ndarray, hosts: np.ndarray, adv: np.ndarray) -> None:
        self.s_rem[idx] -= adv
        self.s_gen[idx] += adv
        self.s_ctx[idx] += adv
        self.tot.generated += float(adv.sum()) * self.w
        fresh = (self.s_v0[idx] < 0) & (adv > 0)
        if fresh.any():
            self.s_v0[idx[fresh]] = self.hversion[hosts[fresh]]

    # -- one tick ----------------------------------------------------------------------------

    def _advance(self, t0: float, t1: float) -> tuple[np.ndarray, np.ndarray]:
        """Decode on rolling hosts from t0 to t1; returns (host, time) of slots freed."""
        dt = t1 - t0
        n = len(self.mode)
        rolling = (self.mode == 1) & (self.target == 1)
        use = np.where(rolling, np.minimum(self.stall, dt), 0.0)
        self.stall -= use
        r = np.nonzero(self.s_state == RUNNING)[0]
        if not len(r):
            return np.zeros(0, np.int64), np.zeros(0)
        h = self.s_host[r]
        k = self.k_run
        # m identical hosts, evenly loaded: each decodes k*w/m real sequences per step
        step = (self.cal.decode_a_s + self.cal.decode_b_s * k * self.w / self.m) / self.cap
        adv_h = np.where(rolling, (dt - use) / step, 0.0)
        # steps to go, its prefill's included (a copy already: fancy indexing)
        before = self.s_rem[r] + self.s_skip[r] if self.cal.prefill_one_step else self.s_rem[r]
        adv = np.minimum(adv_h[h], before)
        self._decode(r, h, adv)
        fin = adv_h[h] >= before - 1e-9
        if not fin.any():
            return np.zeros(0, np.int64), np.zeros(0)
        f, fh = r[fin], h[fin]
        ft = t0 + use[fh] + before[fin] * step[fh]
        self.k_run -= np.bincount(fh, minlength=n)
        self._finish_turns(f, ft)
        return fh, ft

    def _finish_turns(self, f: np.ndarray, ft: np.ndarray) -> None:
        wl = self.wl
        self.lengths.record_recent(self.s_len[f].tolist())
        self.s_host[f] = -1
        more = self.s_turn[f] + 1 < wl.turns
        tool = f[more]
        if len(tool):
            self.s_state[tool] = TOOL
            self.s_turn[tool] += 1
            self.s_ready[tool] = ft[more] + self._latency(self.opt.turn_latency_after_s, len(tool)) + wl.tool_latency_s
            self.s_ctx[tool] += wl.tool_tokens
            self.s_pf[tool] = wl.tool_tokens
            self.s_rem[tool] = self.s_len[tool] = wl.draw(self.rng, len(tool))
        done = f[~more]
        if not len(done):
            return
        if self.opt.turn_latency_after_s > 0:  # the agent's reply and /finish still to come
            self.s_state[done] = FINISHING
            self.s_ready[done] = ft[~more] + self._latency(self.opt.turn_latency_after_s, len(done))
            return
        self._complete(done)

    def _finish_sessions(self) -> None:
        """Sessions whose latency after the engine is over by now complete (in order of when)."""
        if self.opt.turn_latency_after_s <= 0:
            return
        due = np.nonzero((self.s_state == FINISHING) & (self.s_ready <= self.t + 1e-12))[0]
        if len(due):
            self._complete(due[np.argsort(self.s_ready[due], kind="stable")])

    def _complete(self, done: np.ndarray) -> None:
        """Sessions `done` have ended: their samples count, their groups fill."""
        wl = self.wl
        self.tot.samples_done += len(done) * self.w
        self.rate_count += len(done) * self.w
        g = self.s_group[done]
        np.add.at(self.g_left, g, -1)
        np.add.at(self.g_tokens, g, self.s_ctx[done])
        np.add.at(self.g_gen, g, self.s_gen[done])
        np.add.at(self.g_v0sum, g, self.s_v0[done])
        np.minimum.at(self.g_v0min, g, self.s_v0[done])
        self.s_state[done] = FREE
        self.free_slots.extend(done.tolist())
        gs = wl.group_size
        full = sorted(set(g[self.g_left[g] == 0].tolist()))  # np.unique, cheaper for a few groups
        if full:
            self.complete.extend(zip([gs] * len(full), self.g_tokens[full].tolist(), self.g_gen[full].tolist(),
                                     self.g_v0sum[full].tolist(), self.g_v0min[full].tolist()))
            self.available += gs * self.w * len(full)
            self.g_free.extend(full)
        self.open -= len(done) * self.w
        self.untrained += len(done) * self.w

    def _latency(self, mean: float, n: int) -> np.ndarray | float:
        """`n` turns' latency outside the engine: `mean` each, or drawn around it (Options.turn_latency_cv)."""
        cv = self.opt.turn_latency_cv
        if cv <= 0 or mean <= 0:
            return mean
        return self.lat_rng.gamma(1.0 / cv**2, mean * cv**2, n)

    def _wake_tools(self) -> None:
        if self.wl.turns == 1:
            return
        woke = np.nonzero((self.s_state == TOOL) & (self.s_ready <= self.t))[0]
        if len(woke):
            self.s_state[woke] = QUEUED
            self._control(woke[np.argsort(self.s_ready[woke], kind="stable")])

    def _control(self, idx: np.ndarray) -> None:
        """Queued turns `idx` (in arrival order, arrived at s_ready) wait for the control plane:
        a FIFO server doing `control_cores` CPU seconds per second, each turn's work
        `control_s_per_turn` x w and at least that long in wall time, and at least
        `turn_latency_s` after it arrived; s_ready becomes when the turn may be dispatched."""
        c = self.opt.control_s_per_turn * self.w
        lat = self.opt.turn_latency_s
        if (c <= 0 and lat <= 0) or not len(idx):
            return
        arrive = self.s_ready[idx]
        ready = arrive + self._latency(lat, len(idx))  # the latency outside the engine (wall time, not per replica)
        if c > 0:
            service = c / self.opt.control_cores
            start = np.empty(len(idx))
            free = self.cp_free
            for j, a in enumerate(arrive.tolist()):  # a few dozen turns per call
                start[j] = free = max(a, free)
                free += service
            self.cp_free = free
            ready_c = start + max(c, service)
            self.tot.control_wait_s += float((ready_c - arrive).sum())
            self.tot.control_turns += len(idx)
            ready = np.maximum(ready, ready_c)
        self.s_ready[idx] = ready

    # -- the trainer -------------------------------------------------------------------------

    def _trainer(self) -> None:
        """waiting -> ready (a batch of complete groups) -> computing (`gate_s` after the gate
        opens; `start_s` + the batch's compute) -> publishing (the version is out after
        `weight_sync_s`; `bookkeeping_s` more) -> waiting; as many transitions as are due now."""
        while self._trainer_once():
            pass

    def _trainer_once(self) -> bool:
        if self.tstate == "waiting" and self.available >= self.B:
            self._set_trainer("ready")
            return True
        if self.tstate == "ready" and self._gate_open():
            if self.start_at is None:  # the gate opened now: its answer arrives gate_s later
                self.start_at = self.t + self.cal.gate_s
            if self.t < self.start_at - 1e-12:
                self.tr_end = self.start_at  # the tick ends then
                return False
            self.start_at = None
            per_step = self.wl.groups_per_step // self.w
            self.batch = [self.complete.popleft() for _ in range(per_step)]
            self.available -= self.B
            tokens = sum(b[1] for b in self.batch) * self.w
            self.tr_end = self.t + self.cal.start_s + tokens * self.cal.train_s_per_token / self.pool_cap
            self._set_trainer("computing")
            return True
        if self.tstate == "computing" and self.t >= self.tr_end - 1e-12:
            self.tr_end = self.t + self.cal.weight_sync_s
            self._set_trainer("publishing")
            return True
        if self.tstate == "publishing" and self.t >= self.tr_end - 1e-12 and self.booking:
            self.tr_end, self.booking = math.inf, False  # the bookkeeping done
            self._set_trainer("waiting")
            return True
        if self.tstate == "publishing" and self.t >= self.tr_end - 1e-12:
            self.tr_end = math.inf
            for n_s, tokens, gen, v0sum, v0min in self.batch:  # staleness: versions since the oldest token
                self.tot.trained_tokens += tokens * self.w
                self.tot.trained_generated += gen * self.w
                self.tot.staleness_sum += (self.version * n_s - v0sum) * self.w
                self.tot.staleness_max = max(self.tot.staleness_max, self.version - v0min)
                self.tot.trained_samples += n_s * self.w
            self.untrained -= self.B
            self.batch = []
            self.version += 1
            self.step += 1
            rolling = (self.mode == 1) & (self.target == 1)
            self.hversion[rolling] = self.version  # in-place update (keep mode) on rollout hosts
            self.stall[rolling] += self.weight_load_s / self.cap[rolling]
            if self.cal.bookkeeping_s > 0:  # the version is out; the trainer still publishes meanwhile
                self.tr_end, self.booking = self.t + self.cal.bookkeeping_s, True
            else:
                self._set_trainer("waiting")
            if self.opt.progress:
                self.opt.progress(self.step)
            return self.step < self.opt.steps
        return False

    def _set_trainer(self, state: str) -> None:
        if state == "waiting" and self.tstate != "waiting":
            self.waiting_since = self.t
        if state in P.TRAINER_WANTS_HOSTS and self.tstate not in P.TRAINER_WANTS_HOSTS:
            self.wants_since = self.t
        changed, self.tstate = state != self.tstate, state
        if changed:  # the live trainer sends its status at once on a change of state
            self._trainer_status()

    def _held(self) -> int:
        """Real completed sessions the trainer holds now, as shared/admission.py `held_by_trainer` counts
        them: its complete groups (the batch it is ready with among them: the live trainer has taken it)
        and, while it computes or publishes, the batch in hand."""
        return self.available + (self.B if self.tstate in ("computing", "publishing") else 0)

    def _undelivered(self) -> int:
        """Completed sessions the trainer has not fetched (the consumer's pending): none while it fetches,
        which it does until 2 x groups_per_step complete groups wait beside the batch it is ready with;
        then every one not in its complete groups or batch (an upper bound: it fetched some before)."""
        waiting = self.available - (self.B if self.tstate == "ready" else 0)
        return max(0, self.untrained - self._held()) if waiting >= 2 * self.B else 0

    def _trainer_beats(self) -> None:
        """The trainer's periodic statuses due by now."""
        while self.t >= self.status_next - 1e-12:
            self._trainer_status()
            self.status_next += STATUS_INTERVAL_S

    def _trainer_status(self) -> None:
        """A TrainerStatus: what the trajectory manager's admission reads until the next one."""
        self.status_held = self._held()

    # -- accounting --------------------------------------------------------------------------

    def _activity(self) -> np.ndarray:
        table = self.act_table.get(self.tstate)
        if table is None:  # policy.activity over every (mode, target, running > 0)
            table = np.zeros((3, 3, 2), np.int8)
            for a in range(3):
                for b in range(3):
                    for r in range(2):
                        table[a, b, r] = ACTS.index(P.activity(MODES[a], MODES[b], self.tstate, r))
            self.act_table[self.tstate] = table
        return table[self.mode, self.target, (self.k_run > 0).view(np.int8)]

    def _account(self, t0: float, t1: float, act: np.ndarray) -> None:
        self.tot.host_time[self._host_rows, act] += t1 - t0  # one cell per host: no np.add.at needed
        if self.policy == "seamless" and len(self.pool_idx):  # lent pool hosts, and those running nothing
            p = self.pool_idx
            lent = (self.mode[p] == 1) & (self.target[p] == 1)
            self.tot.lent_s += float(np.count_nonzero(lent)) * (t1 - t0) * self.m
            self.tot.lent_idle_s += float(np.count_nonzero(lent & (self.k_run[p] == 0))) * (t1 - t0) * self.m
        if self.tstate in ("waiting", "ready"):
            self.tot.trainer_wait_s += t1 - t0
        if self.opt.timeline:
            ch = np.nonzero(act != self.act_prev)[0]
            for i in ch.tolist():
                if self.act_prev[i] >= 0 and t0 > self.act_since[i]:
                    self.tot.timeline.append((i, float(self.act_since[i]), t0, ACTS[self.act_prev[i]]))
                self.act_since[i] = t0
            self.act_prev = act.copy()

    # -- main loop ---------------------------------------------------------------------------

    def run(self) -> Result:
        opt = self.opt
        self.rate_count = 0.0
        self.pool = {self.index[h] for h in P.train_pool(self.snapshot())}
        self.pool_cap = float(self.cap[sorted(self.pool)].sum()) * self.m if self.pool else 1.0
        self.pool_idx = np.array(sorted(self.pool), np.int64)
        self._admit()  # the first sessions open before the initial placement, which may lend for them
        self._decide()  # initial placement, applied at once: hosts start placed
        self._settle_now()
        self._dispatch(0.0, np.zeros(0, np.int64), np.zeros(0))
        while self.step < opt.steps and self.t < opt.max_time_s:
            t0 = self.t
            # 1. the tick ends at dt or at the next control event
            t1 = min(t0 + opt.dt, float(self.switch_end.min()), self.tr_end if self.tr_end > t0 else math.inf)
            if t1 <= t0:
                t1 = t0 + 1e-9
            act = self._activity()
            # 2. decode, finish turns and sessions
            freed_h, freed_t = self._advance(t0, t1)
            self._account(t0, t1, act)
            self.t = t1
            self._trainer_beats()
            self._finish_sessions()
            a = math.exp(-(t1 - t0) / opt.rate_tau_s)  # completions per second, smoothed
            self.rate = a * self.rate + (1 - a) * self.rate_count / (t1 - t0)
            self.rate_count = 0.0
            # 3. switches that finished; the trainer's state machine (gate included)
            self._settle_switches()
            self._trainer()
            self._admit()  # a publish opens admission at once: the policy's offer counts those turns
            # 4. the policy, every tick, as the live scheduler's control loop calls it
            self._decide()
            self._trainer()  # a reclaim may have been instant (nothing to reclaim)
            # 5. tools return, admission opens sessions, queued turns take free slots
            self._wake_tools()
            self._admit()
            self._dispatch(t0, freed_h, freed_t)
        if opt.timeline:
            for i in range(len(self.mode)):
                if self.act_prev[i] >= 0 and self.t > self.act_since[i]:
                    self.tot.timeline.append((i, float(self.act_since[i]), self.t, ACTS[self.act_prev[i]]))
        inflight = float(self.s_gen[self.s_state != FREE].sum()) * self.w
        queued_gen = sum(g[2] for g in self.complete) * self.w + sum(b[2] for b in self.batch) * self.w
        open_groups = np.ones(len(self.g_left), bool)
        open_groups[self.g_free] = False
        partial = float(self.g_gen[open_groups].sum()) * self.w
        return Result.build(self, inflight + queued_gen + partial)

    def _settle_now(self) -> None:
        self.switch_end[:] = np.where(np.isfinite(self.switch_end), self.t, math.inf)
        self._settle_switches()


def simulate(cluster: Cluster, cal: Calibration, wl: Workload, policy: str, **kw) -> Result:
    return Simulator(cluster, cal, wl, policy, Options(**kw)).run()
