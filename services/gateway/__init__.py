"""The gateway: the HTTP edge agents talk to, in the OpenAI formats.

    python -m services.gateway          # agent API on :8000, admin API on :8001

Modules, from the wire inwards:
    app.py            the agent app's routes and `build_apps` (both apps, one Gateway)
    admin.py          the admin app: keys, /metrics, health; one auth middleware for all routes
    ui.py             the status page (/ui): cookie sign-in, static/ assets, the JSON it polls
    board.py          the status page's history: worker/trainer timelines, rates, rewards (pure)
    chat.py           /v1/chat/completions and /v1/completions: one turn, streaming or not
    responses.py      /v1/responses: a Responses-API turn run as a chat turn; stored responses
    sessions.py       /v1/sessions: create (mints the session key), reward, finish, get
    edge.py           body limits, bearer auth (and the tenant's rate), disconnect watching
    limits.py         per-tenant rate and turns in flight (429), a turn's size (400) (pure)
    schemas.py        request bodies as msgspec Structs (validation and /openapi.json)
    translate.py      bodies -> ChatRequest: the rules a schema cannot say
    openai_format.py  ChatDone/ChatDelta -> OpenAI responses and SSE chunks (pure)
    responses_schemas.py, responses_translate.py, responses_format.py
                      the same three for /v1/responses: its body, -> ChatRequest, -> Response/events
    openapi.py        the OpenAPI 3.1 documents (agent and admin ports), generated from schemas.py
    errors.py         the OpenAI error shape, and what each failure behind the gateway maps to
    service.py        the runtime: NATS (the only module touching it) and the store's lifetime
    store.py          API keys and stored responses in Redis (the only module touching Redis)
    metrics.py        Prometheus metrics and their middleware
    config.py         SF_GATEWAY_* settings

The gateway knows nothing about tokens, chat templates or workers: it validates,
authenticates and forwards OpenAI-level turns to the trajectory manager over sf.chat.
"""
