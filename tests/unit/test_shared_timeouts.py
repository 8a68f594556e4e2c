"""shared/timeouts.py: the timeouts nest, so the inner component reports the real cause first."""

from services.gateway.config import GatewayConfig
from services.rollout.config import RolloutConfig
from services.scheduler.config import HostConfig, SchedulerConfig
from services.scheduler.registry import Registry
from services.trainer.config import TrainerConfig
from services.trajectory.config import TrajectoryConfig
from shared import timeouts
from shared.messages.chat import KEEPALIVE_INTERVAL


def test_gateway_waits_longer_than_the_trajectory_manager_it_calls():
    gw, traj = GatewayConfig(), TrajectoryConfig()
    # no text yet: the trajectory manager waits for a worker, then for that worker's first reply
    assert gw.first_token_timeout > traj.worker_wait + traj.first_token_timeout
    assert gw.idle_timeout > traj.token_timeout


def test_liveness_signals_are_faster_than_the_silence_that_means_death():
    gw = GatewayConfig()
    assert gw.silence_timeout >= 3 * KEEPALIVE_INTERVAL
    assert RolloutConfig(model="m").status_interval == timeouts.HEARTBEAT_INTERVAL
    assert HostConfig().heartbeat == timeouts.HEARTBEAT_INTERVAL
    assert timeouts.HEARTBEAT_STALE_AFTER >= 3 * timeouts.HEARTBEAT_INTERVAL  # a few missed beats, not one


def test_every_heartbeat_listener_uses_one_staleness():
    assert TrajectoryConfig().worker_stale_after == timeouts.HEARTBEAT_STALE_AFTER
    assert TrainerConfig().worker_stale_after == timeouts.HEARTBEAT_STALE_AFTER
    assert GatewayConfig().worker_stale_after == timeouts.HEARTBEAT_STALE_AFTER
    # the scheduler: hosts' agents and their serving workers
    assert SchedulerConfig().host_stale_after == timeouts.HEARTBEAT_STALE_AFTER
    assert Registry().stale_after == timeouts.HEARTBEAT_STALE_AFTER
