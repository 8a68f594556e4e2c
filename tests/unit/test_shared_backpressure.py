"""shared/backpressure.py (pure parts): limits, fill and high-water mark, the crossing detector,
the trim of trained trajectories, the publish back-off bounds."""

from __future__ import annotations

import random

import pytest

from shared import subjects
from shared.backpressure import Fill, HighWater, TrajectoryLimits, backoff, is_stream_full, limits_from_env
from shared.config import ConfigError


def fill(bytes_: int, msgs: int, max_bytes: int = 1000, max_msgs: int = -1, first_seq: int = 1,
         ack_floor: int = -1) -> Fill:
    return Fill(bytes=bytes_, msgs=msgs, max_bytes=max_bytes, max_msgs=max_msgs, first_seq=first_seq,
                ack_floor=ack_floor, pending=0 if ack_floor >= 0 else -1, ack_pending=0 if ack_floor >= 0 else -1)


def test_limits_come_from_the_environment_and_must_nest():
    assert limits_from_env({}) == TrajectoryLimits()
    got = limits_from_env({"SF_TRAJECTORIES_MAX_BYTES": "262144", "SF_TRAJECTORIES_HIGH_WATER": "0.9"})
    assert got.max_bytes == 262144 and got.high_water == 0.9
    with pytest.raises(ValueError):
        limits_from_env({"SF_TRAJECTORIES_TRIM_ABOVE": "0.9"})  # not below the high-water mark
    with pytest.raises(ConfigError):
        limits_from_env({"SF_TRAJECTORIES_MAX_BYTE": "1"})  # a typo is an error, not a default


def test_the_stream_discards_nothing_and_takes_its_limits_from_the_environment(monkeypatch):
    from nats.js.api import DiscardPolicy, RetentionPolicy

    monkeypatch.setenv("SF_TRAJECTORIES_MAX_BYTES", "262144")
    monkeypatch.setenv("SF_TRAJECTORIES_MAX_MSGS", "100")
    traj = subjects.STREAMS[0]  # read at access time, not import time
    assert traj.name == subjects.TRAJECTORIES_STREAM
    assert traj.discard == DiscardPolicy.NEW and traj.retention == RetentionPolicy.LIMITS
    assert (traj.max_bytes, traj.max_msgs) == (262144, 100)


def test_fill_is_the_fuller_of_bytes_and_messages():
    assert fill(500, 1).fraction == 0.5
    assert fill(100, 9, max_msgs=10).fraction == 0.9
    assert fill(100, 9, max_bytes=-1).fraction == 0.0  # no limit at all
    assert fill(800, 1).above(0.8) and not fill(799, 1).above(0.8)


def test_lag_is_undelivered_plus_held_and_unknown_without_a_consumer():
    f = Fill(bytes=0, msgs=0, max_bytes=1, max_msgs=-1, first_seq=1, ack_floor=0, pending=3, ack_pending=4)
    assert f.lag == 7
    assert fill(0, 0).lag == -1


def test_the_high_water_warning_fires_once_per_crossing():
    hw = HighWater(0.8)
    seen = [hw.update(x) for x in (0.5, 0.8, 0.9, 0.79, 0.81, 0.76, 0.74, 0.85)]
    assert seen == [None, "crossed", None, None, None, None, "cleared", "crossed"]


def test_trim_deletes_only_acknowledged_trajectories_oldest_first():
    # 10 messages of 100 bytes (seq 1..10) in a 1000-byte stream, trim to 50%: 5 must go
    assert fill(1000, 10, ack_floor=10).trim_upto(0.5) == 6  # purge below seq 6
    assert fill(1000, 10, ack_floor=3).trim_upto(0.5) == 4  # only what the trainer acknowledged
    assert fill(1000, 10, ack_floor=-1).trim_upto(0.5) is None  # no trainer consumer: nothing is trained
    assert fill(1000, 10, ack_floor=0).trim_upto(0.5) is None
    assert fill(400, 4, ack_floor=4).trim_upto(0.5) is None  # below the trim mark: keep the history
    assert fill(1000, 10, first_seq=20, ack_floor=15).trim_upto(0.5) is None  # already purged past the floor
    assert fill(100, 10, max_msgs=10, ack_floor=10).trim_upto(0.5) == 6  # the message limit counts too


@pytest.mark.parametrize("attempt", range(0, 60))
def test_backoff_is_bounded(attempt):
    rng = random.Random(attempt)
    d = backoff(attempt, base=0.05, cap=1.0, jitter=0.25, rng=rng)
    assert 0.75 * min(1.0, 0.05 * 2**attempt) <= d <= min(1.0, 0.05 * 2**attempt) <= 1.0


def test_backoff_grows_then_stays_at_the_cap():
    no_jitter = [backoff(i, jitter=0) for i in range(8)]
    assert no_jitter[:3] == [0.05, 0.1, 0.2] and no_jitter[-1] == 1.0
    assert all(a <= b for a, b in zip(no_jitter, no_jitter[1:]))
    assert backoff(10**6, jitter=0) == 1.0  # no overflow


def test_stream_full_is_recognised_by_its_error_code():
    class APIError(Exception):
        def __init__(self, err_code):
            self.err_code = err_code

    assert is_stream_full(APIError(10077))
    assert not is_stream_full(APIError(10058)) and not is_stream_full(TimeoutError())
