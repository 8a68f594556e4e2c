"""Operator tooling: the `seamlessflow` command, the local stack launcher and the tiny-model builder.

It starts services as processes and talks to them over HTTP, NATS and Redis; it
imports `shared` but no service module.
"""

__version__ = "0.1.0"
