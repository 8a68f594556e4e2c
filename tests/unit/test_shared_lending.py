"""Which turns a lent worker takes (shared/lending.py): examples, then hypothesis properties."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from shared.lending import DecodeSpeed, LengthHistory, Offer, lent_offer, offer_worth, takes_turn

ONE_GPU = DecodeSpeed(0.012, 0.0002)  # the one-gpu calibration: 12 ms + 0.2 ms per running sequence


def test_fit_takes_only_turns_that_end_before_the_reclaim_and_migrate_weighs_the_re_prefill():
    # 2,000 tokens at 12.2 ms (alone on a fresh host) = 24.4 s
    assert takes_turn(100.0, 130.0, 2000, ONE_GPU.step_s(1))
    assert not takes_turn(100.0, 120.0, 2000, ONE_GPU.step_s(1))  # fit: vacated mid-way
    # migrate: 20 s decode ~1,640 tokens; re-prefilling them (no prompt) at 0.17x costs less
    assert takes_turn(100.0, 120.0, 2000, ONE_GPU.step_s(1), reprefill_ratio=0.17)
    # ... but not with a long context to prefill again for those few tokens
    assert not takes_turn(100.0, 120.0, 2000, ONE_GPU.step_s(1), context_tokens=20_000, reprefill_ratio=0.17)
    assert takes_turn(100.0, 0.0, 10**9, 1.0)  # not lent
    assert not takes_turn(100.0, 100.0, 1, 1e-9)  # drained: lent_until = now
    assert takes_turn(100.0, 120.0, None, 0.01) and takes_turn(100.0, 120.0, 5000, None)  # nothing to predict from


def test_the_speed_is_taken_at_the_batch_the_turn_makes():
    o = Offer(0, 1, 2000, ONE_GPU, 64)
    # 2,000 tokens in 30 s: a step of at most 15 ms, i.e. at most 15 running sequences
    assert lent_offer(o, 0.0, 30.0, 0, 64) == 15
    assert lent_offer(o, 0.0, 30.0, 10, 54) == 5
    assert lent_offer(o, 0.0, 30.0, 0, 0) == 0


def test_a_lent_host_given_nothing_is_worth_nothing():
    fits_nothing = Offer(500, 60, 7200, ONE_GPU, 64)  # the 90th percentile, 88 s even alone, in 80 s: fit
    assert offer_worth(fits_nothing, 80.0) == 0.0
    migrate = Offer(500, 60, 7200, ONE_GPU, 64, reprefill_ratio=0.17)
    assert offer_worth(migrate, 80.0) > 10.0  # more than a switch of 5 + 5 s
    assert offer_worth(Offer(0, 60, 2000, ONE_GPU, 64), 80.0) == 0.0  # no turn waiting


def test_length_history_quantile_per_group_then_overall():
    h = LengthHistory(keep=2, per_group=4)
    assert h.expected("g1") is None
    h.record_recent([10.0, 20.0, 30.0])
    assert h.expected(None) == 30.0 and h.expected("g1") == 30.0
    for n in (100, 400, 120, 110):
        h.record("g1", n)
    assert h.expected("g1") == 400


speeds = st.builds(DecodeSpeed, st.floats(0.0, 0.05), st.floats(0.0, 0.002)).filter(lambda s: s.step_s(1) > 0)


@given(speed=speeds, expected=st.floats(1.0, 20_000.0), window=st.floats(0.01, 500.0),
       running=st.integers(0, 63), free=st.integers(0, 64), ratio=st.one_of(st.none(), st.floats(0.0, 3.0)),
       context=st.floats(0.0, 50_000.0))
def test_a_lent_host_is_offered_work_whenever_any_fits(speed, expected, window, running, free, ratio, context):
    """lent_offer gives exactly the slots whose turn takes_turn accepts at the batch it makes: at
    least one whenever the next turn fits, none beyond the first that does not."""
    o = Offer(0, 1, expected, speed, 64, context, ratio)
    n = lent_offer(o, 0.0, window, running, free)
    assert 0 <= n <= free
    fits = [takes_turn(0.0, window, expected, speed.step_s(running + k), context, ratio) for k in range(1, free + 1)]
    assert fits[:n] == [True] * n
    assert n == free or not fits[n]
    if free and fits[0]:
        assert n >= 1


def test_refill_counts_the_turns_a_slot_takes_after_its_first():
    # at start-up the finished replies are the short ones: 41 tokens predicted, 1,536 turns a host
    short = Offer(49_152, 32, 41.0, ONE_GPU, 64, reprefill_ratio=0.17)
    one_each = offer_worth(short, 80.0)
    refilled = offer_worth(Offer(49_152, 32, 41.0, ONE_GPU, 64, reprefill_ratio=0.17, refill=True), 80.0)
    assert one_each < 2.0 < 10.0 < refilled  # one turn a slot: nothing; refilled: the host stays busy
    # a slot's share is 24 turns of 41 tokens (~984 tokens): all of it, no more
    full = 64 * 984 * ONE_GPU.step_s(64) / 64
    assert abs(refilled - full) < 0.05 * full
    # as many turns as slots: refill changes nothing for turns that end in the window
    few = dict(turns=64, hosts=1, expected_tokens=2000.0, speed=ONE_GPU, slots=64, reprefill_ratio=0.17)
    assert abs(offer_worth(Offer(**few, refill=True), 80.0) - offer_worth(Offer(**few), 80.0)) < 1e-6


@given(speed=speeds, expected=st.floats(1.0, 20_000.0), window=st.floats(0.01, 500.0), turns=st.integers(0, 5000),
       hosts=st.integers(1, 64), ratio=st.one_of(st.none(), st.floats(0.0, 1.0)), context=st.floats(0.0, 5000.0))
def test_refill_is_never_worth_less_than_one_turn_a_slot_and_nothing_when_nothing_fits(
        speed, expected, window, turns, hosts, ratio, context):
    base = Offer(turns, hosts, expected, speed, 64, context, ratio)
    one, more = offer_worth(base, window), offer_worth(Offer(turns, hosts, expected, speed, 64, context, ratio,
                                                             refill=True), window)
    if turns and lent_offer(base, 0.0, window, 0, min(64, -(-turns // hosts))):
        assert more >= one - 1e-9
    else:
        assert more == one == 0.0
    assert more <= window * (1 + 1e-9)  # a whole window decoding at full batch is the most a host adds


def test_rebalanced_evens_the_load_out_between_a_busy_worker_and_one_that_begins_serving():
    from shared.lending import REBALANCE, rebalanced
    assert rebalanced(64, 64, 0, 64, REBALANCE) == 32  # both end at half
    assert rebalanced(64, 64, 0, 32, REBALANCE) == 21  # a smaller newcomer takes less: 43/64 and 21/32
    assert rebalanced(60, 64, 10, 64, REBALANCE) == 25
    assert rebalanced(20, 64, 10, 64, REBALANCE) == 0  # within REBALANCE (a quarter) of each other
    assert rebalanced(0, 64, 0, 64, REBALANCE) == 0
    assert rebalanced(80, 64, 30, 32, 0.0) == 2  # over its slots (queued turns counted): no more than fit


def test_a_reply_that_has_run_long_is_predicted_by_the_longer_replies_only():
    from shared.lending import LengthHistory
    h = LengthHistory()
    h.record_recent([100.0] * 18 + [1000.0, 4000.0])
    assert h.remaining(None, 0) == 1000.0  # the 90th percentile of all twenty
    assert h.remaining(None, 50) == 950.0
    assert h.remaining(None, 500) == 3500.0  # past 100: only 1,000 and 4,000 were that long
    assert h.remaining(None, 4000) is None  # none was longer: nothing to predict from
    h.record("g", 96.0)
    assert h.remaining("g", 48) == 48.0  # its group's, where it has one


def test_the_rest_of_a_lend_is_the_sooner_of_the_prediction_and_the_lends_measured():
    from shared.lending import LendHistory
    h = LendHistory()
    assert h.window(100.0, 180.0, 95.0) == 80.0  # nothing measured: the prediction (lent_until)
    assert h.window(100.0, 0.0, 95.0) == float("inf")  # no reclaim predicted
    for s in (20.0, 22.0, 30.0):
        h.record(s)
    assert h.window(100.0, 180.0, 95.0) == 17.0  # began at 95, lends last 22 s: 17 s left
    assert h.window(100.0, 110.0, 95.0) == 10.0  # a prediction sooner than that stands
    assert h.window(100.0, 0.0, 95.0) == 17.0


def test_level_is_where_rebalanced_leaves_the_new_worker():
    from shared.lending import REBALANCE, level, rebalanced
    assert level(64, 64, 0, 64) == 32.0 == rebalanced(64, 64, 0, 64, REBALANCE)
    assert level(60, 64, 10, 64) == 35.0


def test_a_short_turn_moves_to_an_idle_lent_worker_and_a_long_one_that_outlasts_the_lend_does_not():
    from shared.lending import Move, move_worth
    # live, 2 hosts: 48 of 96 tokens to go at 18 ms a token beside 63 others, against 2.25 ms on the lent
    # worker; 80 tokens of context at 0.07 ms each delay the 32 it runs once even: 0.86 s - 0.11 s - 0.18 s
    short = Move(48, 80, 0.018, 0.00225, 0.00007, busy_running=63, lent_batch=32)
    assert move_worth(short, 2.0) > 0.5
    assert move_worth(short, float("inf")) == move_worth(short, 2.0)  # both finish within the window
    # one-gpu at split 60: 3,800 tokens in, 6,000 to go, at 24.8 ms against 12.2 ms, in a lend of 22 s: it
    # finishes in neither place before the reclaim (saves nothing counted) and pays the re-prefill twice
    long = Move(6000, 3800, 0.0248, 0.0122, 1 / 15_000, busy_running=63, lent_batch=32)
    assert move_worth(long, 22.0) < 0
    # ... but where the lend lasts long enough for it to finish there, it is worth moving
    assert move_worth(long, 100.0) > 0
    # nothing to predict its length from: never moved; a lend already over: never
    assert move_worth(Move(None, 80, 0.018, 0.00225, 0.00007), 2.0) == float("-inf")
    assert move_worth(short, 0.0) == float("-inf")
    # a request waiting for a slot in a full engine saves its wait too
    queued = Move(96, 32, 0.018, 0.018, 0.00007, wait_s=1.0, busy_running=63, lent_batch=32)
    assert move_worth(queued, 5.0) > 0.9
    # prefill owed on the lent worker before it (the moves before this one) delays it there
    assert move_worth(Move(48, 80, 0.018, 0.00225, 0.00007, lent_stall_s=0.5), 2.0) < move_worth(short, 2.0)


@given(st.floats(1, 1e4), st.floats(0, 1e4), st.floats(1e-4, 0.1), st.floats(1e-4, 0.1), st.floats(0.1, 1e3))
def test_moving_to_a_worker_no_faster_never_pays(remaining, context, busy_step, lent_step, window):
    """Property: a request whose step on the lent worker is no shorter than where it is saves nothing
    that its re-prefill does not cost."""
    from shared.lending import Move, move_worth
    m = Move(remaining, context, busy_step, max(lent_step, busy_step), 1e-5, busy_running=7, lent_batch=4)
    assert move_worth(m, window) <= 0
