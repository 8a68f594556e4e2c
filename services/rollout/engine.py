"""One vLLM `AsyncLLM`, token ids in, token ids and behaviour logprobs out, plus the
operations the RL loop needs: abort one request, vacate (abort all), resume, and an
in-place weight reload that bumps the policy version.

The engine knows token ids and weight directories. It knows nothing about text,
chat templates, sessions or NATS (`service.py` owns the transport).

Rules the rest of the system relies on:
- every delta is stamped with the weight version being served when vLLM produced it;
- when a request finishes "stop", its last token is the EOS/stop token (vLLM 0.32
  includes it in `token_ids`; `_pump` appends it if a vLLM ever does not);
- a request ended by `abort`, `pause_abort_all` or a dead engine finishes
  "preempted", and every token sampled before that was already yielded;
- a weight directory is checked before the reload, and after a failed reload the
  engine is dead: it is never resumed (vLLM would run on half-loaded weights);
- the reload runs in vLLM's worker through `vllm_ext.py`, which also repacks the CPU
  kernels that vLLM's own `reload_weights` leaves stale (a tied LM head);
- a vacate never waits behind a weight load: while one holds the engine, the vacate
  aborts the requests around it (vLLM ends an aborted request at once, paused or not);
- `sleep`/`wake`: vLLM sleep level 1 / `wake_up` where the platform has sleep mode (GPU:
  weights offloaded, KV cache freed); elsewhere (CPU) a pause / resume that frees nothing.
  No weights are loaded into a sleeping engine.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.rollout.config import RolloutConfig, initial_version
from services.rollout.sampling import eos_token_ids, finish_reason, sampling_kwargs
from shared.checkpoint import TensorSpecs, check_checkpoint
from shared.deltas import merge_deltas
from shared.messages.rollout import ErrorCode, FinishReason, Sampling, TokenDelta

log = logging.getLogger(__name__)

WORKER_EXTENSION = "services.rollout.vllm_ext.RolloutWorkerExtension"  # adds reload_weights_in_place
RELOAD_TIMEOUT = 600.0  # seconds; a reload that takes longer leaves the engine dead
ABORT_SWEEPS = 5  # vacate: rounds of aborting requests that raced the pause
ABORT_SWEEP_GAP = 0.05  # seconds between those rounds
# After a pause: lets the pumps read what vLLM emitted before it (AsyncLLM has already handed
# those outputs to the requests' collectors when pause_generation returns; the pumps only
# need event-loop turns, and the reload's own awaits give them more before the version bump).
SETTLE_SECONDS = 0.005


class EngineError(RuntimeError):
    """One request failed (bad request or a vLLM error); the engine still serves. `code` says
    whose fault it was, for GenerateDone.code."""

    def __init__(self, message: str, code: ErrorCode = "internal"):
        super().__init__(message)
        self.code = code


class EngineAsleep(RuntimeError):
    """The operation needs an awake engine (a weight load): wake it first."""


class EngineDead(RuntimeError):
    """The engine cannot serve any more; the process should exit."""


@dataclass(slots=True)
class Delta:
    token_ids: list[int]
    logprobs: list[float]
    version: int
    finish: FinishReason | None = None  # set on the last delta of a request
    error: str = ""


@dataclass(slots=True)
class _End:
    """Queued after a request's last tokens: how it finished."""

    finish: FinishReason
    error: str = ""
    version: int = 0


@dataclass(slots=True)
class _Stream:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # TokenDelta | _End | BaseException
    pump: asyncio.Task | None = None
    stamped: list[list[int]] = field(default_factory=list)  # [version, n_tokens] runs
    aborted: bool = False


def engine_env(cfg: RolloutConfig) -> dict[str, str]:
    """The environment vLLM reads at engine start that comes from our settings."""
    return {"VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_cache_gib)}


def _is(e: BaseException, name: str) -> bool:
    # vLLM's exceptions are matched by name, so this module imports vLLM only to start it
    return any(c.__name__ == name for c in type(e).__mro__)


def _vllm_request(prompt_ids: list[int], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    from vllm import SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(**kwargs, output_kind=RequestOutputKind.DELTA)
    return TokensPrompt(prompt_token_ids=prompt_ids), params


def _build_llm(cfg: RolloutConfig) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(
        model=cfg.model,
        skip_tokenizer_init=True,
        dtype=cfg.dtype,
        enforce_eager=cfg.enforce_eager,
        max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        seed=cfg.seed,
        disable_log_stats=True,
        worker_extension_cls=WORKER_EXTENSION,
        enable_sleep_mode=sleep_mode_available(),  # level-1 sleep needs vLLM's cumem allocator (GPU)
    )
    return AsyncLLM.from_engine_args(args)


def sleep_mode_available() -> bool:
    """Whether vLLM can really sleep here (free weights and KV cache): CUDA yes, CPU no."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


class Engine:
    def __init__(self, cfg: RolloutConfig, llm: Any = None):
        self.cfg = cfg
        self.version = initial_version(cfg)
        self.dead = ""  # why, once the engine is dead
        self.vacated = False
        self.updating = False
        self.sleeping = False
        self.gpu_sleep = False  # sleep frees memory (vLLM sleep level 1); else sleep is a pause
        self.last_update: dict[str, float] = {}  # timings of the last in-place weight update
        self._llm = llm
        self._eos: list[int] = eos_token_ids(cfg.model)
        self._reference: TensorSpecs | None = None
        self._streams: dict[str, _Stream] = {}
        self._lock = asyncio.Lock()  # pause/resume/load, one at a time

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self, warmup: bool = True) -> None:
        """Build the engine (blocking: tens of seconds on CPU) and warm it up."""
        self._reference = check_checkpoint(self.cfg.model)
        if self._llm is None:
            # explicit, not a default: a launcher's environment must not override SF_ROLLOUT_KV_CACHE_GIB
            os.environ.update(engine_env(self.cfg))
            self._llm = _build_llm(self.cfg)
            self.gpu_sleep = sleep_mode_available()
        await self._llm.update_weight_version(str(self.version))
        if warmup:
            # The first request that asks for logprobs pays a one-time warm-up of seconds.
            async for _ in self.generate("warmup", [0, 1], Sampling(max_tokens=2, temperature=0.0)):
                pass
        if not self._eos:
            log.warning("no eos_token_id in %s: only stop_token_ids end a request", self.cfg.model)
        if self.cfg.start_vacated:  # the scheduler assigns it work with a resume
            await self.pause_abort_all()

    def shutdown(self, timeout: float = 10.0) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown(timeout=timeout)
        # Dropping the last reference now lets AsyncLLM.__del__ run while the interpreter
        # is whole (at exit it raises "'NoneType' object is not callable").

    @property
    def running(self) -> int:
        return len(self._streams)

    # -- generation -----------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_ids: list[int], sampling: Sampling) -> AsyncIterator[Delta]:
        """Deltas of one request; the last has `finish` set. Raises EngineError / EngineDead
        before the first delta if the request cannot start."""
        if self.dead:
            raise EngineDead(self.dead)
        if request_id in self._streams:
            raise EngineError(f"request {request_id!r} is already running", "bad_request")
        n, limit = len(prompt_ids), self.cfg.max_model_len
        if n == 0:
            raise EngineError("empty prompt", "bad_request")
        if n >= limit:
            raise EngineError(f"prompt of {n} tokens is longer than max_model_len={limit} allows ({limit - 1})",
                              "context_length")
        try:
            prompt, params = _vllm_request(list(prompt_ids), sampling_kwargs(sampling, self._eos))
        except Exception as e:  # vLLM validates the sampling values here
            raise EngineError(f"bad sampling: {e}", "bad_request") from None
        stream = _Stream()
        self._streams[request_id] = stream
        stream.pump = asyncio.create_task(self._pump(request_id, prompt, params, stream))
        try:
            while True:
                for item in _deltas([await stream.queue.get(), *_drain(stream.queue)]):
                    if isinstance(item, BaseException):
                        raise item
                    yield item
                    if item.finish is not None:
                        return
        finally:
            if not stream.pump.done():
                stream.pump.cancel()  # vLLM aborts a request whose consumer is cancelled
            self._streams.pop(request_id, None)

    async def _pump(self, request_id: str, prompt: Any, params: Any, stream: _Stream) -> None:
        """Read vLLM's outputs as soon as they exist, so each is stamped with the version
        that produced it even while the consumer is busy sending the previous one."""
        last_token: int | None = None
        if stream.aborted or self.vacated:  # aborted or vacated before it reached vLLM
            stream.queue.put_nowait(_End("preempted", version=self.version))
            return
        try:
            async for out in self._llm.generate(prompt, params, request_id):
                if stream.aborted and not out.finished and not stream.stamped:
                    # The abort may have reached vLLM before the request did: abort again
                    # now that vLLM surely knows it (aborting twice is harmless).
                    await self._llm.abort(request_id)
                c = out.outputs[0]
                ids = list(c.token_ids)
                lps = [_sampled_logprob(d, t) for d, t in zip(c.logprobs or (), ids)]
                lps += [math.nan] * (len(ids) - len(lps))
                if ids:
                    last_token = ids[-1]
                finish = finish_reason(c.finish_reason) if out.finished else None
                if finish == "stop" and isinstance(c.stop_reason, int) and last_token != c.stop_reason:
                    # The contract: a "stop" stream ends with its EOS/stop token. vLLM 0.32 sends it;
                    # if a vLLM does not, append it (its logprob is unknown).
                    log.warning("vLLM left stop token %d out of %s; appending it", c.stop_reason, request_id)
                    ids.append(c.stop_reason)
                    lps.append(math.nan)
                if ids:
                    _stamp(stream.stamped, self.version, len(ids))
                    stream.queue.put_nowait(TokenDelta(request_id, ids, lps, self.version))
                if finish is not None:
                    stream.queue.put_nowait(_End(finish, version=self.version))
                if out.finished:
                    _check_versions(request_id, stream.stamped, getattr(c, "weight_versions", None))
                    return
            stream.queue.put_nowait(EngineError("vLLM ended the request without a final output"))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if _is(e, "EngineDeadError"):
                self._mark_dead(f"vLLM engine died: {e}")
                return  # _mark_dead ended this stream
            cause = e.__cause__ if _is(e, "EngineGenerateError") and e.__cause__ else e
            stream.queue.put_nowait(EngineError(f"{type(cause).__name__}: {cause}"))

    async def abort(self, request_id: str) -> bool:
        """End one request now; it finishes "preempted". False if it is not running here."""
        stream = self._streams.get(request_id)
        if stream is None or self.dead:
            return False
        stream.aborted = True
        await self._llm.abort(request_id)
        return True

    # -- pause, resume, weights -----------------------------------------------------------------

    async def pause_abort_all(self) -> None:
        """Vacate: every in-flight request finishes "preempted" with all its tokens, and the
        engine takes no new request until `resume`.

        `vacated` is set before the first await, so a status sent right after the call
        starts already says so. A vacate never waits behind a weight load (or another
        operation holding the engine): it then only aborts the requests, which ends them
        at once in a paused vLLM too, and the load does not resume a vacated engine."""
        if self.dead:
            return
        self.vacated = True
        if not self._lock.locked():
            async with self._lock:
                if not self.dead:
                    await self._llm.pause_generation(mode="abort")
        # A request still on its way into vLLM when the pause came would sit in the paused
        # engine's queue and never finish: abort every stream we know, a few times, until
        # each has ended.
        for _ in range(ABORT_SWEEPS):
            if not self._streams or self.dead:
                break
            for rid, stream in list(self._streams.items()):
                stream.aborted = True
                await self._llm.abort(rid)
            await asyncio.sleep(ABORT_SWEEP_GAP)

    async def resume(self) -> None:
        if self.sleeping:
            log.warning("resume of a sleeping engine: waking it first")
            await self.wake()
        async with self._lock:
            if self.dead:
                raise EngineDead(self.dead)
            # cleared before the await: a vacate that comes meanwhile must stay in force
            self.vacated = False
            await self._llm.resume_generation()

    async def sleep(self, keep: bool = False) -> None:
        """Put the engine to sleep. Without `keep`, vacate first (if not vacated already); with
        `keep`, in-flight requests stay frozen in place and go on after `wake`."""
        if self.dead:
            raise EngineDead(self.dead)
        if not keep and not self.vacated:
            await self.pause_abort_all()
        async with self._lock:
            if self.dead:
                raise EngineDead(self.dead)
            if self.sleeping:
                return
            mode = "keep" if keep else "abort"
            if self.gpu_sleep:
                await self._llm.sleep(level=1, mode=mode)
            else:  # CPU: nothing to free; pausing the scheduler is all sleep would do
                await self._llm.pause_generation(mode=mode, clear_cache=False)
            self.sleeping = True

    async def wake(self) -> None:
        """Undo `sleep`. A vacated engine stays vacated (no requests) until `resume`."""
        async with self._lock:
            if self.dead:
                raise EngineDead(self.dead)
            if not self.sleeping:
                return
            if self.gpu_sleep:
                await self._llm.wake_up()
            else:
                await self._llm.resume_generation()
            self.sleeping = False

    async def load_weights(self, path: str | Path, version: int) -> None:
        """Pause in keep mode, reload weights in place from `path`, bump the version, resume.

        Raises CheckpointError (nothing touched, still serving the old version) or
        EngineDead (the reload failed halfway; in-flight requests end "preempted") or
        EngineAsleep (nothing touched)."""
        async with self._lock:
            if self.dead:
                raise EngineDead(self.dead)
            if self.sleeping:  # on GPU its weights are offloaded: a reload would fail halfway
                raise EngineAsleep(f"not loading version {version} into a sleeping engine; wake it first")
            # 1. check the directory while still serving: a bad one must not reach vLLM
            check_checkpoint(path, self._reference)
            self.updating = True
            t0 = time.perf_counter()
            try:
                # 2. freeze requests (their KV cache is dropped and recomputed with the new weights)
                await self._llm.pause_generation(mode="keep", clear_cache=True)
                await asyncio.sleep(SETTLE_SECONDS)
                t1 = time.perf_counter()
                # 3. reload; a failure here leaves vLLM with half-loaded weights: never resume
                try:
                    # vllm_ext: vLLM's reload_weights, plus a repack of the tied LM head
                    rpc = self._llm.collective_rpc("reload_weights_in_place", kwargs={"weights_path": str(path)})
                    repacked = await asyncio.wait_for(rpc, RELOAD_TIMEOUT)
                except BaseException as e:
                    self._mark_dead(f"reload of {path} failed: {type(e).__name__}: {e}")
                    if isinstance(e, asyncio.CancelledError):
                        raise
                    raise EngineDead(self.dead) from e
                log.info("reloaded %s (repacked layers per worker: %s)", path, repacked)
                t2 = time.perf_counter()
                # 4. tokens sampled from here on come from `version`
                self.version = version
                await self._llm.update_weight_version(str(version))
                if not self.vacated:
                    await self._llm.resume_generation()
                t3 = time.perf_counter()
                self.last_update = {"version": version, "pause_ms": 1000 * (t1 - t0),
                                    "load_ms": 1000 * (t2 - t1), "resume_ms": 1000 * (t3 - t2)}
                log.info("weight update v%d: pause %.1f ms, load %.1f ms, resume %.1f ms", version,
                         *(self.last_update[k] for k in ("pause_ms", "load_ms", "resume_ms")))
            finally:
                self.updating = False

    def _mark_dead(self, why: str) -> None:
        if not self.dead:
            log.error("engine dead: %s", why)
            self.dead = why
        me = asyncio.current_task()
        for stream in list(self._streams.values()):
            if stream.pump is not None and stream.pump is not me and not stream.pump.done():
                stream.pump.cancel()
            stream.queue.put_nowait(_End("preempted", f"worker engine dead: {why}", self.version))


def _drain(queue: asyncio.Queue) -> list:
    """What is already queued, without waiting."""
    out = []
    while not queue.empty():
        out.append(queue.get_nowait())
    return out


def _deltas(items: list) -> list[Delta | BaseException]:
    """The consumer's view of queued items: runs of one version merged (shared/deltas.py: a
    consumer that fell behind catches up in one message instead of one per token), and the
    end marker folded into the tokens just before it."""
    out: list[Delta | BaseException] = []
    for item in merge_deltas(items):
        if isinstance(item, TokenDelta):
            out.append(Delta(item.token_ids, item.logprobs, item.version))
        elif isinstance(item, _End):
            last = out[-1] if out else None
            if isinstance(last, Delta) and last.finish is None:
                last.finish, last.error = item.finish, item.error
            else:
                out.append(Delta([], [], item.version, item.finish, item.error))
        else:
            out.append(item)
    return out


def _sampled_logprob(entry: Any, token_id: int) -> float:
    # logprobs=0: a {token_id: Logprob} dict holding the sampled token only
    if entry is None:
        return math.nan
    lp = entry.get(token_id)
    return float(lp.logprob) if lp is not None else math.nan


def _stamp(runs: list[list[int]], version: int, n: int) -> None:
    if runs and runs[-1][0] == version:
        runs[-1][1] += n
    else:
        runs.append([version, n])


def _check_versions(request_id: str, stamped: list[list[int]], spans: Any) -> None:
    """Compare our per-delta stamps with vLLM's own per-token version spans."""
    if not spans:
        return
    theirs: list[list[int]] = []
    for s in spans:
        try:
            _stamp(theirs, int(s.version), s.end - s.start)
        except (ValueError, AttributeError):
            return
    if theirs != stamped:
        log.warning("request %s: version stamps %s differ from vLLM's %s", request_id, stamped, theirs)
