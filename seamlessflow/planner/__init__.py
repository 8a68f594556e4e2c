"""`seamlessflow plan`: capacity planning on a SIMULATED cluster, before a GPU is spent.

    plan.py       sweeps of hosts, splits and policies; the tables and plots it writes

The one exception to seamlessflow's rule of importing no service module: `seamlessflow.planner`
runs the scheduler's SIMULATED cluster in-process (services.scheduler.sim), which drives the
scheduler's own placement policy in virtual time. It imports nothing else from services/.
"""
