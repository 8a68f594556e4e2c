"""services/trainer/runner.py: the staleness histogram the trainer logs each step (pure part)."""

from services.trainer.batching import Row
from services.trainer.runner import staleness
from shared.messages.trajectory import Sample


def test_staleness_counts_loss_tokens_by_versions_behind():
    # prompt tokens (mask 0) never count; each sampled token counts once, by its own version
    a = Sample([1, 2, 3, 4], [0, 1, 1, 0], [0.0, -0.1, -0.2, 0.0], [-1, 5, 5, -1])
    b = Sample([1, 2, 3], [0, 1, 1], [0.0, -0.1, -0.2], [-1, 3, 6])
    assert staleness([Row(a, 0.0, 0), Row(b, 0.0, 1)], version=6) == {0: 1, 1: 2, 3: 1}
    assert staleness([], version=6) == {}
