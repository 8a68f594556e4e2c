"""Run the gateway: the agent API and the admin API, two uvicorn servers on one event loop.

    SF_GATEWAY_API_KEYS=sk-dev SF_GATEWAY_ADMIN_KEY=admin-dev python -m services.gateway

SIGINT/SIGTERM set a quit event; both servers then stop taking connections,
finish the requests in flight, and the shared NATS/Redis clients close last.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import uvicorn

from services.gateway.app import build_apps
from services.gateway.config import load_config
from shared.config import connections, log_level
from shared.lifecycle import quit_on_signals, run, settle

log = logging.getLogger("services.gateway")


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # main() owns the signals: one quit event stops both servers


async def main() -> int:
    cfg, conn = load_config(), connections()
    agent, admin = build_apps(cfg, conn)
    servers = [_Server(uvicorn.Config(app, host=cfg.host, port=port, http=cfg.http, log_level="info", access_log=False,
                                      timeout_graceful_shutdown=30, timeout_keep_alive=cfg.keepalive_timeout))
               for app, port in ((agent, cfg.port), (admin, cfg.admin_port))]
    quit = quit_on_signals()

    tasks = [asyncio.create_task(s.serve()) for s in servers]
    while not all(s.started for s in servers):
        if any(t.done() for t in tasks):  # a port in use, a failed lifespan: uvicorn has said why
            quit.set()
            break
        await asyncio.sleep(0.05)
    else:
        log.info("gateway ready: agent API http://%s:%d/v1, admin http://%s:%d (NATS %s, Redis %s)",
                 cfg.host, cfg.port, cfg.host, cfg.admin_port, *conn.redacted().values())
        settle()
    waiter = asyncio.ensure_future(quit.wait())
    await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    for s in servers:
        s.should_exit = True
    await asyncio.gather(*tasks, return_exceptions=True)
    log.info("gateway stopped")
    return 0 if all(s.started for s in servers) else 1


if __name__ == "__main__":
    logging.basicConfig(level=log_level(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    raise SystemExit(run(main()))
