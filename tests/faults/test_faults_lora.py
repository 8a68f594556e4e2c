"""The trainer fault case with LoRA on (issue 27): the same stack as test_faults.py, its trainer
training a rank-4 adapter (every version an adapter dir, every checkpoint the adapter's and its
optimizer state), SIGKILLed right after a checkpoint, before the next publish. The invariants of
invariants.py hold, the trainer resumes from the adapter checkpoint, and no version is published
twice.

    .venv/bin/python -m pytest tests/faults/test_faults_lora.py
"""

from __future__ import annotations

import pytest

from shared.checkpoint import is_adapter
from tests.faults import test_faults as base
from tests.faults.harness import FaultStack, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.deepspeed, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    s = FaultStack(tmp_path_factory.mktemp("faults-lora"), tiny_model, trainer={"lora_rank": 4})
    try:
        s.start()
        wait_for(lambda: base.serving(s) == base.HOSTS, 60, "both hosts serving", every=0.3)
        yield s
    finally:
        s.stop()


def test_lora_trainer_sigkill_between_checkpoint_and_publish(stack):
    base.test_trainer_sigkill_between_checkpoint_and_publish(stack)
    # the versions it published, before and after the kill, are adapter dirs
    versions = sorted(p for p in stack.stack.weights_dir.glob("v*") if p.is_dir())
    assert versions and all(is_adapter(v) for v in versions), versions
