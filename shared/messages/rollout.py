"""sf.rollout.*: token-level generation between the trajectory manager and rollout workers.

A rollout worker knows token ids only; it never sees text or chat templates.
Replies to a `Generate` stream to the request's reply inbox as zero or more
`TokenDelta` followed by exactly one `GenerateDone`. A Generate that asks for a receipt
(`Generate.receipt`) gets, first and at once, a `TokenDelta` with no tokens (its version the
worker's): the requester knows within seconds that the Generate arrived (core NATS may drop one
while the worker reconnects), and waits for the first token only after it.

Wire compatibility of the receipt, both ways: a requester asks for one only from a worker whose
`WorkerStatus.receipts` says it sends them (one from before reads as False, and is waited for as
before); a worker sends one only when asked (a requester from before never asks, and gets the
replies it always got). Both fields are appended with defaults, so either side from before reads
the other's messages (a trailing array_like field, an unknown map key: both ignored).
"""

from __future__ import annotations

from typing import Literal

import msgspec


class Sampling(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: list[int] = []
    logit_bias: dict[int, float] = {}


class Generate(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """Command: generate up to `sampling.max_tokens` tokens after `prompt_ids`."""

    request_id: str
    # a sender may pass msgspec.Raw holding the msgpack array itself (the trajectory manager splices a
    # session's cached path that way, services/trajectory/tokenpath.py): the same bytes on the wire
    prompt_ids: list[int]
    sampling: Sampling
    session_id: str = ""
    # the worker may hold tokens back and send them merged, at most this often (seconds; shared/deltas.Held):
    # the requester's agent does not stream, so nobody watches them live. 0: each as it comes. Workers
    # from before it ignore it (a trailing field of an array_like Struct)
    hold_s: float = 0.0
    # multi-LoRA: the agent role (its session's metadata "role") whose adapter the worker runs it on,
    # where a version holds one adapter per role; "" otherwise. Appended like hold_s
    adapter: str = ""
    # send a receipt first, at once: a TokenDelta with no tokens (see the module docstring). Appended like
    # hold_s; asked only of workers whose WorkerStatus.receipts is set
    receipt: bool = False


class TokenDelta(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Tokens sampled since the previous delta, each with its behaviour logprob. One with no tokens,
    first, is a receipt (Generate.receipt); a consumer skips empty deltas."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    version: int


FinishReason = Literal["stop", "length", "preempted", "error"]
# Why a request ended "error": the caller's fault (the prompt does not fit the context window,
# bad sampling values) or the worker's. "" on any other finish, and from workers that predate it.
ErrorCode = Literal["", "context_length", "bad_request", "internal"]


class GenerateDone(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """The last reply to a Generate.

    `preempted` means the worker paused in abort mode (vacate): every token sampled
    so far was already sent (as deltas, or as this message's tail), and the caller should
    continue elsewhere.
    `error` is for people; `code` is what a caller may act on. `scheduled` marks a
    preemption the tag scheduler caused (a vacate with `RolloutControl.scheduled`): the
    caller re-dispatches it without counting it as a failure.
    """

    request_id: str
    finish_reason: FinishReason
    num_prompt_tokens: int
    version: int
    worker_id: str = ""
    error: str = ""
    code: ErrorCode = ""
    scheduled: bool = False
    # the last tokens, when the Generate set hold_s: what the worker still held at the end (version
    # `version`), sent with this message instead of in a TokenDelta of their own (shared/deltas.tail_of)
    tail_ids: list[int] = []
    tail_logprobs: list[float] = []


RolloutReply = TokenDelta | GenerateDone


# serving: takes work; updating: loading weights in place (in-flight requests frozen, then go on);
# vacated: takes no work, in-flight requests were ended "preempted"; sleeping: vacated or frozen
# (RolloutControl.keep), and the engine asleep (on GPU its memory is freed); paused: stopping, dead, or
# awake without weights (a level-2 wake of network-received weights, until the trainer sends them again)
WorkerState = Literal["serving", "paused", "vacated", "updating", "sleeping"]


class WorkerStatus(msgspec.Struct, tag=True, omit_defaults=True):
    """Event: a rollout worker's heartbeat, published every `status_interval` seconds."""

    worker_id: str
    state: WorkerState
    version: int
    running: int
    capacity: int
    model: str
    max_model_len: int
    ts: float
    host: str = ""
    generated_tokens: int = 0
    lent_until: float = 0.0  # wall clock: when the scheduler expects to reclaim this worker (0 = not lent)
    # a random id of this worker process: a worker restarted under the same worker_id has a new one, so a
    # stream its dead predecessor was serving is noticed at once (its heartbeats look fresh otherwise)
    instance: str = ""
    # this worker answers a Generate with `receipt` set by a receipt (an empty TokenDelta) before any token;
    # False from a worker that predates receipts: the requester then asks for none
    receipts: bool = False


RolloutOp = Literal["abort", "vacate", "resume", "load", "sleep", "wake"]


class RolloutControl(msgspec.Struct, tag=True, omit_defaults=True, forbid_unknown_fields=True):
    """Command to one worker (request/reply on sf.rollout.ctl.<worker_id>; the reply is a
    WorkerStatus):

    - `abort`: end one request (`request_id`) now; its GenerateDone says "preempted".
    - `vacate`: abort every in-flight request (each ends "preempted") and take no new work.
    - `resume`: take work again after a vacate.
    - `load`: pause in keep mode, load weight `version` from `path`, resume. Refused (the
      reply shows the old version) while the worker sleeps: wake it first.
    - `sleep`: put the engine to sleep (vLLM sleep level 1 on GPU: weights offloaded, KV cache
      freed; on CPU a pause that frees nothing). Without `keep` it vacates first if it was
      not vacated; with `keep`, in-flight requests stay frozen in place and go on after `wake`
      (a colocated train phase).
    - `wake`: undo `sleep`. A worker that was vacated stays vacated until `resume`, so the
      scheduler's lend sequence is wake, load, resume.

    `scheduled` (vacate, sleep) marks the preemptions this causes in their GenerateDone;
    `lent_until` (resume, wake) is reported back in WorkerStatus.
    """

    op: RolloutOp
    request_id: str = ""
    version: int = 0
    path: str = ""
    scheduled: bool = False  # a vacate the tag scheduler caused
    keep: bool = False  # sleep: keep in-flight requests frozen in place instead of vacating
    lent_until: float = 0.0  # resume / wake: when the scheduler expects to reclaim it (0 = not lent)
