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
