"""HostAgent construction: which resident worker it would run (no NATS, no process started)."""

from services.scheduler.config import load_host
from services.scheduler.host import HostAgent
from shared.config import connections


def _agent(**kw) -> HostAgent:
    return HostAgent(load_host(id="h0", tags="train,rollout", **kw), connections({}))


def test_default_worker_is_the_rollout_service():
    a = _agent(model="var/model")
    assert a.has_worker
    assert a.worker_argv[1:] == ["-m", "services.rollout", "--model", "var/model", "--worker-id", "h0-rollout"]


def test_worker_cmd_replaces_the_worker_for_benchmarks():
    a = _agent(model="var/model", worker_cmd="python bench/simulated_engine.py --capacity 64")
    assert a.has_worker
    assert a.worker_argv == ["python", "bench/simulated_engine.py", "--capacity", "64", "--model", "var/model",
                             "--worker-id", "h0-rollout"]


def test_no_model_no_worker_even_with_worker_cmd():
    a = _agent(worker_cmd="python bench/simulated_engine.py")
    assert not a.has_worker
