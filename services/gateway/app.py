"""The agent app (port 8000): OpenAI formats, sessions, health, schema. Assembled here, with
the admin app, around one Gateway whose lifespan owns the NATS and Redis clients.

    agent, admin = build_apps(load_config(), connections())
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from services.gateway import admin, chat, openapi, responses, sessions
from services.gateway.config import GatewayConfig
from services.gateway.edge import JSON, authenticate
from services.gateway.errors import EXCEPTION_HANDLERS, ApiError
from services.gateway.metrics import MetricsMiddleware
from services.gateway.service import Gateway
from shared.config import Connections


def _model(gw: Gateway) -> dict:
    return {"id": gw.cfg.model, "object": "model", "created": gw.started, "owned_by": "seamlessflow"}


async def list_models(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    await authenticate(request, gw.keys, gw.limiter)
    return JSON({"object": "list", "data": [_model(gw)]})


async def get_model(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    await authenticate(request, gw.keys, gw.limiter)
    name = request.path_params["model"]
    if name != gw.cfg.model:
        raise ApiError(404, f"The model `{name}` does not exist; this gateway serves `{gw.cfg.model}`.",
                       "model_not_found", "model")
    return JSON(_model(gw))


async def openapi_json(request: Request) -> Response:
    return JSON(request.app.state.openapi)


ROUTES: list[BaseRoute] = [
    Route("/v1/chat/completions", chat.chat_completions, methods=["POST"]),
    Route("/v1/completions", chat.completions, methods=["POST"]),
    Route("/v1/responses", responses.create, methods=["POST"]),
    Route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model:path}", get_model, methods=["GET"]),
    Route("/v1/sessions", sessions.create, methods=["POST"]),
    Route("/v1/sessions/{session_id}", sessions.get, methods=["GET"]),
    Route("/v1/sessions/{session_id}/reward", sessions.reward, methods=["POST"]),
    Route("/v1/sessions/{session_id}/finish", sessions.finish, methods=["POST"]),
    Route("/healthz", admin.healthz, methods=["GET"]),  # the same check on both ports
    Route("/openapi.json", openapi_json, methods=["GET"]),
]


def create_agent_app(gw: Gateway) -> Starlette:
    app = Starlette(
        routes=ROUTES,
        middleware=[Middleware(MetricsMiddleware, metrics=gw.metrics)],
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=lambda app: gw.lifespan(),
    )
    app.state.gateway = gw
    app.state.openapi = openapi.document(gw.cfg)
    return app


def build_apps(cfg: GatewayConfig, conn: Connections,
               admin_routes: Sequence[BaseRoute] = ()) -> tuple[Starlette, Starlette]:
    """The agent app and the admin app, sharing one Gateway (its clients open with the first
    lifespan and close with the last). `admin_routes` extends the admin app."""
    gw = Gateway(cfg, conn)
    return create_agent_app(gw), admin.create_admin_app(gw, admin_routes)
