"""The trajectory manager: sessions, chat templates, token-exact trajectories, routing,
partial rollout and staleness admission.

    python -m services.trajectory --model var/model      # one replica; run N behind queue "trajectory"

Modules, from the wire inwards:
    service.py       NATS wiring (the only module touching NATS): sf.chat, sf.session.*,
                     sf.chat.cancel, sf.rollout.status, the policy-version watch
    chat.py          one agent turn, in numbered steps: lookup, prompt, generation, record; the lease
    turnstream.py    a turn's streaming state: stop-string and tool-call hold-back
                     (shared/toolcalls.py), offsets, progress cadence, deltas waiting to be persisted
    record.py        a finished generation -> the Turn to store and the ChatDone to send
    sessions.py      create (admission) / get / reward / finish (TrajectoryCompleted)
    generation.py    one generation across preemptions: dispatch, segments, re-dispatch
    rendering.py     chat templates and tokens; continuation without re-tokenizing; streamed text
    conversation.py  canonical messages and conversation keys
    turns.py         the per-session token prefix tree and its samples
    routing.py       worker table (shared/heartbeats.py) and the picker: sticky, then least loaded
    store.py         Redis (the only module touching it)
    config.py        SF_TRAJECTORY_* settings

It knows nothing about HTTP, vLLM or the trainer: text and messages come in over sf.chat,
token ids go out over sf.rollout.gen.<worker>.
"""
