"""Operator tooling: the `seamlessflow` command, the local stack launcher and the tiny-model builder.

    python -m seamlessflow --help

It starts services as processes and talks to them over HTTP, NATS and Redis; it imports
`shared` but no service module, with one exception: `seamlessflow.planner` runs the
scheduler's SIMULATED cluster in-process (services.scheduler.sim). tests/unit/test_layering.py
checks both.

    cli.py        the `seamlessflow` command: parses arguments, calls into the packages below
    modelgen.py   builds the tiny models the demo and the tests run (`seamlessflow init-model`)
    stack/        the local stack as processes: spawn, supervise, stop (`seamlessflow up`)
    ops/          operator commands over NATS: workers, weights, hosts, dead letters, export
    demo/         the RL demo and its tasks, warm start, live view and report (`seamlessflow demo`)
    planner/      capacity planning on a SIMULATED cluster (`seamlessflow plan`)
"""

__version__ = "0.1.0"
