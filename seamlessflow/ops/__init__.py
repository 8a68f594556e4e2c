"""Operator commands against a running stack, over NATS (one module per `seamlessflow` command group).

    workers.py    `workers`, `weights`, and the bus half of `status`
    hosts.py      `hosts` and `timeline`: the tag scheduler's control subject
    dead.py       `dead`: the DEAD stream's letters
    export.py     `export`: finished trajectories as JSONL

It may import `shared`, never a service module: it speaks only the wire contract.
"""
