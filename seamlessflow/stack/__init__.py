"""The stack on one machine as child processes, for `seamlessflow up`, the demo, tests and benchmarks.

    processes.py  Stack: spawn, wait for ready lines, respawn, stop in tiers; StackOptions, client_env
    servers.py    the embedded nats-server and redis-server
    tls.py        `up --tls`: a private CA and the servers' and services' certificates (openssl)
    supervisor.py restart back-off, crash loops, shutdown order, scale plans (pure: time passed in)
    keeper.py     the running `seamlessflow up`: applies supervisor.py to processes.py
    control.py    its control channel (a Unix socket) for `seamlessflow status` and `scale`

It may import `shared`, never a service module or another seamlessflow subpackage: services
are started as `python -m services.X` processes.
"""

from seamlessflow.stack.processes import (
    ENGINE_ENV,
    HostSpec,
    Proc,
    Stack,
    StackError,
    StackOptions,
    client_env,
    host_specs,
    log_tail,
    parse_hosts,
    split_cpus,
    strip_login,
)

__all__ = ["ENGINE_ENV", "HostSpec", "Proc", "Stack", "StackError", "StackOptions", "client_env", "host_specs",
           "log_tail", "parse_hosts", "split_cpus", "strip_login"]
