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


def test_what_the_trainer_holds_is_its_complete_groups_and_the_batch_in_hand():
    from shared.admission import held_by_trainer

    assert held_by_trainer(ready_groups=3, group_size=8, groups_per_step=2, state="waiting") == 24
    for state in ("ready", "computing", "publishing"):
        assert held_by_trainer(3, 8, 2, state) == 24 + 16
    assert held_by_trainer(0, 8, 2, "stopped") == 0
