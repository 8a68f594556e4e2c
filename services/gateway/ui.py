"""The status page on the admin port: /ui, its login, its static files and the JSON it polls.

    http://127.0.0.1:8001/ui                    a login form: paste the admin key
    http://127.0.0.1:8001/ui?key=<admin key>    the same in one step (then redirected to /ui)

A browser cannot easily send a bearer header, so the admin key is exchanged once for a
cookie: HttpOnly, SameSite=Strict, holding an HMAC of the key (never the key itself), so it
stops working when the key is rotated. The cookie opens only the page and the read-only
/ui/api/* routes; /admin/* and /metrics still need the bearer header. The key is never
logged (the gateway runs uvicorn without an access log); prefer the form to `?key=`, which
a proxy in front might log.

    GET /ui/api/status?window=120   workers (and hosts, from the tag scheduler) with their
                                    activity intervals, versions served, in-flight turns and
                                    sessions, turns/s, tokens/s, rewards, the trainer's state,
                                    reward and staleness

The page (static/ui.html, ui.js, ui.css: plain JS and inline SVG, no CDN, no build) polls it
every 2 s. The trainer's Prometheus metrics are scraped from SF_GATEWAY_TRAINER_METRICS_URL
at most once per poll interval.
"""

from __future__ import annotations

import hashlib
import hmac
import html
import time
from pathlib import Path
from urllib.parse import parse_qs

import httpx
import msgspec
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from services.gateway.edge import JSON, read_body, same_secret
from services.gateway.service import Gateway

STATIC = Path(__file__).with_name("static")
ASSETS = {"ui.js": "text/javascript", "ui.css": "text/css"}
COOKIE = "sf_ui"
COOKIE_MAX_AGE = 12 * 3600
OPEN_PATHS = frozenset({"/ui", "/ui/login", "/ui/logout"} | {f"/ui/static/{a}" for a in ASSETS})
COOKIE_PREFIX = "/ui/api/"  # the only paths the cookie opens (GET only), besides the page itself
SCRAPE_EVERY = 2.0
# The page's own headers: no framing, nothing loaded from anywhere but this port.
HEADERS = {"cache-control": "no-store", "x-frame-options": "DENY", "referrer-policy": "no-referrer",
           "content-security-policy": "default-src 'self'; frame-ancestors 'none'; form-action 'self'"}
_TRAINER_GAUGES = {"sf_trainer_last_reward_mean": "reward_mean", "sf_trainer_last_reward_std": "reward_std",
                   "sf_trainer_last_staleness_mean": "staleness_mean", "sf_trainer_last_staleness_max": "staleness_max",
                   "sf_trainer_last_loss": "loss", "sf_trainer_last_train_tokens_per_s": "tokens_per_s",
                   "sf_trainer_step": "step", "sf_trainer_weight_version": "version"}


def ui_token(admin_key: str) -> str:
    """The cookie's value: an HMAC of the admin key (rotating the key logs every browser out)."""
    return hmac.new(admin_key.encode(), b"seamlessflow-ui-v1", hashlib.sha256).hexdigest()


def cookie_ok(request: Request, admin_key: str) -> bool:
    return bool(admin_key) and same_secret(request.cookies.get(COOKIE, ""), ui_token(admin_key))


def _bearer_ok(request: Request, admin_key: str) -> bool:
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and same_secret(given.strip(), admin_key)


def _login_page(message: str, status: int) -> HTMLResponse:
    note = f'<p class="note">{html.escape(message)}</p>' if message else ""
    body = f"""<!doctype html><html lang="en"><head><meta charset="utf-8"><title>SeamlessFlow status: sign in</title>
<link rel="stylesheet" href="/ui/static/ui.css"></head><body class="login">
<form method="post" action="/ui/login"><h1>SeamlessFlow status</h1>{note}
<label>Admin key (SF_GATEWAY_ADMIN_KEY)<input type="password" name="key" autocomplete="current-password" autofocus></label>
<button type="submit">Sign in</button></form></body></html>"""
    return HTMLResponse(body, status_code=status, headers=HEADERS)


def _signed_in(admin_key: str) -> Response:
    resp = RedirectResponse("/ui", status_code=303, headers=HEADERS)
    resp.set_cookie(COOKIE, ui_token(admin_key), max_age=COOKIE_MAX_AGE, path="/", httponly=True, samesite="strict")
    return resp


async def page(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    key = gw.cfg.admin_key
    if not key:
        return _login_page("The admin API is disabled: set SF_GATEWAY_ADMIN_KEY.", 401)
    given = request.query_params.get("key")
    if given is not None:
        return _signed_in(key) if same_secret(given, key) else _login_page("Wrong admin key.", 401)
    if cookie_ok(request, key) or _bearer_ok(request, key):
        return FileResponse(STATIC / "ui.html", media_type="text/html", headers=HEADERS)
    return _login_page("", 401)


async def login(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    form = parse_qs((await read_body(request, 4096)).decode(errors="replace"))
    given = (form.get("key") or [""])[0].strip()
    if gw.cfg.admin_key and same_secret(given, gw.cfg.admin_key):
        return _signed_in(gw.cfg.admin_key)
    return _login_page("Wrong admin key.", 401)


async def logout(request: Request) -> Response:
    resp = RedirectResponse("/ui", status_code=303, headers=HEADERS)
    resp.delete_cookie(COOKIE, path="/")
    return resp


async def asset(request: Request) -> Response:
    name = request.path_params["name"]
    if name not in ASSETS:
        return Response(status_code=404)
    return FileResponse(STATIC / name, media_type=ASSETS[name], headers={"cache-control": "no-cache"})


def parse_trainer_metrics(text: str) -> dict[str, object]:
    """The sf_trainer_* gauges the page shows, from a Prometheus text exposition; the loss
    tokens by versions behind (`sf_trainer_token_staleness_total{lag}`) as `staleness_tokens`."""
    out: dict[str, object] = {}
    lag: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in _TRAINER_GAUGES:
                out[_TRAINER_GAUGES[s.name]] = s.value
            elif s.name == "sf_trainer_token_staleness_total":
                lag[s.labels.get("lag", "?")] = s.value
    if lag:
        out["staleness_tokens"] = lag
    return out


async def _scrape_trainer(gw: Gateway, now: float) -> None:
    board, url = gw.board, gw.cfg.trainer_metrics_url
    if not url or now - board.scraped_at < SCRAPE_EVERY:
        return
    board.scraped_at = now
    try:
        async with httpx.AsyncClient(timeout=1.0) as client:
            r = await client.get(url)
            r.raise_for_status()
        board.trainer_metrics, board.trainer_metrics_error = parse_trainer_metrics(r.text), ""
    except (httpx.HTTPError, ValueError) as e:
        board.trainer_metrics_error = f"trainer metrics not reachable at {url}: {type(e).__name__}"


def _hosts(reply) -> dict | None:
    if reply is None or not reply.ok:
        return None
    return {"policy": reply.policy, "counts": reply.counts,
            "hosts": [{**msgspec.to_builtins(h), "timeline": [[i.activity, i.t_start, i.t_end] for i in h.timeline]}
                      for h in reply.hosts]}


async def status(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    try:
        window = min(max(float(request.query_params.get("window", 120)), 10.0), 900.0)
    except ValueError:
        window = 120.0
    now = time.time()
    gw.sample_counters(now)
    await _scrape_trainer(gw, now)
    snap = gw.board.snapshot(now, window, gw.worker_table(), gw.cfg.worker_stale_after)
    hosts = _hosts(await gw.scheduler_timeline())
    if hosts is not None:
        since = now - window
        for h in hosts["hosts"]:
            h["timeline"] = [[a, max(t0, since), t1] for a, t0, t1 in h["timeline"] if t1 >= since]
    m = gw.metrics
    created, finished = m.value("sf_gateway_sessions_total", {"event": "created"}), m.value(
        "sf_gateway_sessions_total", {"event": "finished"})
    snap.update(scheduler=hosts, in_flight_turns=int(m.value("sf_gateway_in_flight_requests")),
                sessions_created=int(created), sessions_finished=int(finished),
                in_flight_sessions=max(0, int(created - finished)), turns_total=int(m.value("sf_gateway_turns_total")),
                model=gw.cfg.model, health=await gw.health())
    return JSON(snap, headers={"cache-control": "no-store"})


ROUTES: list[BaseRoute] = [
    Route("/ui", page, methods=["GET"]),
    Route("/ui/login", login, methods=["POST"]),
    Route("/ui/logout", logout, methods=["GET", "POST"]),
    Route("/ui/static/{name}", asset, methods=["GET"]),
    Route("/ui/api/status", status, methods=["GET"]),
]
