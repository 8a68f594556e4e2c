"""services/rollout/simulated.py stands in for the vLLM engine inside the real RolloutService: it
must offer every engine attribute the service reads (a new one broke every simulated worker's
status, and with it the fault suite's stacks)."""

from __future__ import annotations

import ast
from pathlib import Path

from services.rollout.config import RolloutConfig
from services.rollout.service import RolloutService
from services.rollout.simulated import SimulatedEngine
from shared.config import Connections

SERVICE = Path(__file__).resolve().parents[2] / "services" / "rollout" / "service.py"


def engine_attributes_read_by_the_service() -> set[str]:
    """Every `self.engine.<name>` (and `e.<name>` where e = self.engine) in service.py."""
    tree = ast.parse(SERVICE.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            inner = node.value
            if inner.attr == "engine" and isinstance(inner.value, ast.Name) and inner.value.id == "self":
                names.add(node.attr)
    return names


def test_the_simulated_engine_has_every_attribute_the_service_reads():
    engine = SimulatedEngine(4)
    read = engine_attributes_read_by_the_service()
    assert {"needs_refill", "sleeping", "vacated", "version"} <= read  # the scan sees what it should
    missing = sorted(n for n in read if not hasattr(engine, n))
    assert not missing, f"SimulatedEngine lacks {missing}"


def test_a_service_around_the_simulated_engine_reports_its_state():
    svc = RolloutService(RolloutConfig(model="sim", worker_id="sim-0"), Connections(), engine=SimulatedEngine(4))
    assert svc.status().state == "serving"
    svc.engine.vacated = True
    assert svc.status().state == "vacated"
