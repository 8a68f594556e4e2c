"""The admin app (port 8001): key management, rollout workers (list, vacate, resume),
Prometheus metrics, health, and the status page (/ui, see ui.py).

Every route but /healthz needs `Authorization: Bearer <SF_GATEWAY_ADMIN_KEY>`; agent
keys never work here. With no admin key configured, the admin API refuses
everything (401) but /healthz. The status page signs a browser in with a cookie, which
opens /ui/api/* (GET) and nothing else. Authentication is one middleware, so routes added
later (e.g. /admin/workers) are protected without doing anything:

    agent, admin = build_apps(cfg, conn, admin_routes=[Route("/admin/workers", workers)])

A handler reaches the shared runtime as `request.app.state.gateway`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence

import msgspec
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from services.gateway import openapi, ui
from services.gateway.edge import JSON, read_body, same_secret
from services.gateway.errors import EXCEPTION_HANDLERS, ApiError
from services.gateway.limits import TenantLimits
from services.gateway.schemas import KeyCreate, decode
from services.gateway.service import Gateway
from services.gateway.store import key_id
from shared.bus import NoResponders, ReplyTimeout

# a worker id is one NATS subject token (services/rollout/config.py): no dots, wildcards or spaces
WORKER_ID = re.compile(r"[A-Za-z0-9_\-:@]{1,200}")
OPEN_PATHS = frozenset({"/healthz", "/openapi.json"}) | ui.OPEN_PATHS  # the page answers a login form itself


class AdminAuthMiddleware:
    def __init__(self, app: ASGIApp, admin_key: str) -> None:
        self.app = app
        self.admin_key = admin_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            error = self._refuse(Request(scope))
            if error is not None:
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refuse(self, request: Request) -> ApiError | None:
        if not self.admin_key:
            return ApiError(401, "the admin API is disabled: set SF_GATEWAY_ADMIN_KEY", "admin_disabled")
        if (request.method == "GET" and request.url.path.startswith(ui.COOKIE_PREFIX)
                and ui.cookie_ok(request, self.admin_key)):
            return None
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not same_secret(given.strip(), self.admin_key):
            return ApiError(401, "this endpoint needs the admin key", "invalid_api_key")
        return None


async def create_key(request: Request) -> Response:
    """A new user API key. The key itself is in this response only; Redis keeps its hash."""
    gw: Gateway = request.app.state.gateway
    body = decode(await read_body(request, gw.cfg.max_body_bytes), KeyCreate)
    own = TenantLimits(body.rate_limit, body.rate_burst, body.max_concurrent)
    key, record = await gw.keys.add_user_key(body.name or "", own if own != TenantLimits() else None)
    return JSON({"api_key": key, "key_id": key_id(key), "kind": record.kind, "name": record.name,
                 "created": record.created, "limits": _limits_json(gw, record.limits)}, status_code=201)


def _limits_json(gw: Gateway, own: TenantLimits | None) -> dict:
    """The limits that hold for the key on this gateway: its own, else the gateway's settings."""
    own = own or TenantLimits()
    return {"rate_limit": gw.cfg.rate_limit if own.rate_limit is None else own.rate_limit,
            "rate_burst": gw.cfg.rate_burst if own.rate_burst is None else own.rate_burst,
            "max_concurrent": gw.cfg.max_concurrent if own.max_concurrent is None else own.max_concurrent}


def _worker_json(s) -> dict:
    return {"id": s.worker_id, "state": s.state, "version": s.version, "running": s.running,
            "capacity": s.capacity, "model": s.model, "generated_tokens": s.generated_tokens,
            "host": s.host, "age_s": round(time.time() - s.ts, 2)}


async def list_workers(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    return JSON({"workers": [_worker_json(s) for s in gw.worker_table()]})


async def steer_worker(request: Request) -> Response:
    """POST /admin/workers/{id}/vacate | /resume: vacate aborts the worker's in-flight requests
    (the trajectory manager re-dispatches them) and keeps it from taking new ones."""
    gw: Gateway = request.app.state.gateway
    worker_id, op = request.path_params["worker_id"], request.path_params["op"]
    if op not in ("vacate", "resume"):
        raise ApiError(404, f"unknown worker operation {op!r}; use vacate or resume", "not_found")
    if not WORKER_ID.fullmatch(worker_id):  # one NATS subject token, or no worker has it
        raise ApiError(404, f"no rollout worker {worker_id!r} is listening", "worker_not_found")
    try:
        status = await gw.control_worker(worker_id, op)
    except NoResponders:  # NATS itself down stays a 503 (errors.py)
        raise ApiError(404, f"no rollout worker {worker_id!r} is listening", "worker_not_found") from None
    except ReplyTimeout:
        raise ApiError(504, f"rollout worker {worker_id!r} did not answer", "timeout") from None
    return JSON(_worker_json(status))


async def list_hosts(request: Request) -> Response:
    """GET /admin/hosts: the tag scheduler's hosts (tags, mode, target, epoch, health, activity)."""
    gw: Gateway = request.app.state.gateway
    try:
        reply = await gw.scheduler_status()
    except NoResponders:  # NATS itself down stays a 503 (errors.py)
        raise ApiError(404, "no scheduler is running (start the stack with --policy)", "scheduler_not_found") from None
    except ReplyTimeout:
        raise ApiError(504, "the scheduler did not answer", "timeout") from None
    return JSON({"policy": reply.policy, "counts": reply.counts, "hosts": msgspec.to_builtins(reply.hosts)})


async def metrics(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    await gw.read_stream_fill()  # the TRAJECTORIES fill and the trainer's lag, fresh at each scrape
    return Response(gw.metrics.render(), media_type=gw.metrics.content_type)


async def openapi_json(request: Request) -> Response:
    return JSON(request.app.state.openapi)


async def healthz(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    state = await gw.health()
    return JSON(state, status_code=200 if all(v == "ok" for v in state.values()) else 503)


ROUTES: list[BaseRoute] = [
    Route("/admin/keys", create_key, methods=["POST"]),
    Route("/admin/workers", list_workers, methods=["GET"]),
    Route("/admin/hosts", list_hosts, methods=["GET"]),
    Route("/admin/workers/{worker_id}/{op}", steer_worker, methods=["POST"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/healthz", healthz, methods=["GET"]),
    Route("/openapi.json", openapi_json, methods=["GET"]),
    *ui.ROUTES,
]


def create_admin_app(gw: Gateway, extra_routes: Sequence[BaseRoute] = ()) -> Starlette:
    app = Starlette(
        routes=[*ROUTES, *extra_routes],
        middleware=[Middleware(AdminAuthMiddleware, admin_key=gw.cfg.admin_key)],
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=lambda app: gw.lifespan(),
    )
    app.state.gateway = gw
    app.state.openapi = openapi.admin_document(gw.cfg)
    return app
