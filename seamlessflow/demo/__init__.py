"""`seamlessflow demo`: RL on one machine, end to end, and what it is made of.

    run.py        the demo's steps: model, warm start, stack, rounds, live view, report
    rl.py         the RL rounds: openai-SDK agents through the gateway, TRAINER_SETTINGS
    tasks.py      the verifiable tasks and rewards (pure)
    warmstart.py  a short supervised warm start so RL starts from a policy that sometimes succeeds
    live.py       the live terminal view
    telemetry.py  what the demo watches over NATS while it runs
    report.py     the report folder a run leaves behind
    workload.py   a steady GRPO agent workload for the scheduler's tests and benchmarks

It may import `shared`, seamlessflow.stack, seamlessflow.ops and seamlessflow.modelgen, never a
service module: it drives the services over HTTP and NATS.
"""
