"""shared/admission.py: the staleness bound, in sessions the trainer trains per version."""

from shared.admission import Admission, Backlog, staleness


def test_admission_bound_and_staleness():
    a = Admission(max_staleness=1)
    assert a.enabled and a.capacity(4) == 8
    assert a.admit(open_sessions=5, backlog=Backlog(untrained=2, per_version=4))
    assert not a.admit(open_sessions=5, backlog=Backlog(untrained=3, per_version=4))
    assert "staleness bound (8" in a.refusal(5, Backlog(3, 4))
    assert not Admission(-1).enabled and Admission(-1).admit(10**6, Backlog(10**6, 1))
    assert staleness(5, [-1, 3, 4, -1, 5]) == 2
    assert staleness(5, [-1]) == 0 and staleness(-1, [0]) == 0
