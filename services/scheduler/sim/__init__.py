"""A SIMULATED cluster for benchmarks and capacity planning: never used by the running service.

    from services.scheduler.sim import CALIBRATIONS, WORKLOADS, Cluster, simulate
    r = simulate(Cluster.uniform(16, train_hosts=4), CALIBRATIONS["decode-heavy"],
                 WORKLOADS["long-tail"], policy="seamless", steps=50)

No model runs and no NATS or Redis is touched: hosts generate and train tokens at a calibrated
speed in virtual time, placed by the scheduler's own policy.py. `python -m services.scheduler`
imports nothing from here; bench/pipeline*.py and `seamlessflow plan` (seamlessflow/planner/)
run it in-process.

Modules:
    simulator.py  Cluster, Options, Simulator, simulate: virtual time, the hosts' running
                  sequences and the trainer's state machine, driven by policy.py
    workload.py   what it runs: Calibration (one host's costs, CALIBRATIONS) and the GRPO
                  Workload (WORKLOADS); knows nothing about policies or time
    result.py     what a run measured: Totals while it runs, Result's derived figures
"""

from services.scheduler.sim.result import ACTS, Result, Totals
from services.scheduler.sim.simulator import Cluster, Options, Simulator, simulate
from services.scheduler.sim.workload import CALIBRATIONS, WORKLOADS, Calibration, Workload, scaled

__all__ = ["ACTS", "CALIBRATIONS", "WORKLOADS", "Calibration", "Cluster", "Options", "Result", "Simulator",
           "Totals", "Workload", "scaled", "simulate"]
