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
    # no text yet: the trajectory manager waits for a worker, for its receipt (a lost Generate is re-dispatched
    # after it, once at least within the gateway's wait), then for that worker's first token
    assert gw.first_token_timeout > traj.worker_wait + traj.receipt_timeout + traj.first_token_timeout
    assert gw.idle_timeout > traj.token_timeout


def test_a_lost_generate_is_noticed_in_seconds_and_no_later_than_a_dead_worker():
    traj = TrajectoryConfig()
    assert traj.receipt_timeout == timeouts.WORKER_RECEIPT
    # short: the receipt is the only wait that vLLM's warm-up does not stand behind ...
    assert 0 < traj.receipt_timeout <= timeouts.HEARTBEAT_STALE_AFTER < traj.first_token_timeout
    # ... but not so short that a loaded box's delivery of a receipt (milliseconds) comes near it
    assert traj.receipt_timeout >= 3 * timeouts.HEARTBEAT_INTERVAL


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
