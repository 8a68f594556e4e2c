"""docs/configuration.md against the config classes: every setting listed with its real default,
and no setting listed that nothing reads."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec

from services.gateway.config import GatewayConfig
from services.rollout.config import RolloutConfig
from services.scheduler.config import HostConfig, SchedulerConfig
from services.trainer.config import TrainerConfig
from services.trajectory.config import TrajectoryConfig
from shared.backpressure import TrajectoryLimits
from shared.config import Connections

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "configuration.md"
CLASSES = [(Connections, "SF_"), (GatewayConfig, "SF_GATEWAY_"), (TrajectoryConfig, "SF_TRAJECTORY_"),
           (RolloutConfig, "SF_ROLLOUT_"), (TrainerConfig, "SF_TRAINER_"), (SchedulerConfig, "SF_SCHEDULER_"),
           (HostConfig, "SF_HOST_"), (TrajectoryLimits, "SF_TRAJECTORIES_")]
# Read outside a config class; each must still be read somewhere in these files.
PROCESS_WIDE = {"SF_LOG_LEVEL": "shared/config.py", "SF_JETSTREAM_REPLICAS": "shared/config.py", "SF_EVENT_LOOP": "shared/lifecycle.py", "SF_WEIGHTS_DIR": "services/trainer/config.py",
                "SF_DATA_DIR": "justfile", "SF_PROFILE": "scripts/bootstrap.sh", "SF_BROWSER": "scripts/bootstrap.sh",
                "SF_SMOLLM2": "scripts/bootstrap.sh",
                "SF_TEST_CACHE": "tests/conftest.py"}


def doc_rows() -> dict[str, str]:
    rows = re.findall(r"^\| `(SF_[A-Z0-9_]+)` \| `([^`]*)` \|", DOC.read_text(), re.M)
    names = [n for n, _ in rows]
    assert len(names) == len(set(names)), "a setting is listed twice"
    return dict(rows)


def shown(value) -> str:
    if value is msgspec.NODEFAULT:
        return "(required)"
    if isinstance(value, bool):
        return "true" if value else "false"
    return '""' if value == "" else str(value)


def expected() -> dict[str, str]:
    out = {}
    for cls, prefix in CLASSES:
        for f in msgspec.structs.fields(cls):
            out[prefix + f.name.upper()] = shown(f.default)
    return out


def test_every_setting_is_documented_with_its_default():
    rows = doc_rows()
    missing = [n for n in expected() if n not in rows]
    wrong = [f"{n}: the document says {rows[n]!r}, the code {d!r}" for n, d in expected().items()
             if n in rows and rows[n] != d]
    assert not missing, f"missing from docs/configuration.md: {missing}"
    assert not wrong, wrong


def test_every_documented_setting_exists():
    known = expected()
    for name in doc_rows():
        if name in known:
            continue
        assert name in PROCESS_WIDE, f"docs/configuration.md lists {name}, which no config class has"
        assert name in (ROOT / PROCESS_WIDE[name]).read_text(), f"{name} is not read in {PROCESS_WIDE[name]}"
