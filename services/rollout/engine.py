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
- weights come over the network (`receive_weights`: vLLM's RL weight-transfer API, the backend
  `transfer_backend` picks; on CPU shared/weightxfer.py over gloo) or from a directory
  (`load_weights`, the shared-disk path);
- a weight directory is checked before the reload, a round that cannot be joined touches
  nothing, and after a failed reload or receive the engine is dead: it is never resumed (vLLM
  would run on half-loaded weights);
- the reload runs in vLLM's worker through `vllm_ext.py`, which also repacks the CPU
  kernels that vLLM's own `reload_weights` leaves stale (a tied LM head);
- a vacate never waits behind a weight load: while one holds the engine, the vacate
  aborts the requests around it (vLLM ends an aborted request at once, paused or not);
- `sleep`/`wake`: vLLM sleep (`sleep_level`: 1 offloads the weights to host memory, 2
  discards them; both free the KV cache) where the platform has sleep mode (CUDA/ROCm/XPU);
  elsewhere (CPU) a pause / resume that frees nothing. After a level-2 sleep the wake is
  staged: `wake` restores the weight memory only (`wake_up(["weights"])`), the next
  `load_weights` fills it, and only then does `wake_up(["kv_cache"])` run; a `resume` with
  no load in between reloads the version served before the sleep. No weights are loaded
  into a sleeping engine. `start_asleep` sleeps right after start-up (a train host's worker);
- a version received over the network has no path on disk (`served_path` None): after a level-2
  sleep such an engine `needs_refill`, and `resume` raises WeightsGone (it never serves discarded
  weights) until a load or a receive fills them (the service asks the trainer for a round).
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
from typing import Any, NoReturn

from services.rollout.adapters import AdapterTable, lora_id
from services.rollout.config import RolloutConfig, engine_args, initial_version
from services.rollout.sampling import eos_token_ids, finish_reason, sampling_kwargs
from shared.checkpoint import CheckpointError, TensorSpecs, check_checkpoint, is_adapter_version
from shared.deltas import merge_deltas
from shared.logonce import OncePerCause
from shared.messages.rollout import ErrorCode, FinishReason, Sampling, TokenDelta
from shared.messages.weights import TransferBackend, WeightTransfer

log = logging.getLogger(__name__)

WORKER_EXTENSION = "services.rollout.vllm_ext.RolloutWorkerExtension"  # adds reload_weights_in_place
RELOAD_TIMEOUT = 600.0  # seconds; a reload (or a network receive) that takes longer leaves the engine dead
JOIN_TIMEOUT = 30.0  # seconds a worker waits to join a transfer round (the sender's join window is shorter)
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


class WeightsGone(RuntimeError):
    """A level-2 sleep discarded the weights of a version that came over the network: there is no
    path to reload them from, so the engine serves nothing until a receive (or a load) fills them."""


class TransferMissed(RuntimeError):
    """The worker could not join a version's transfer round (too late, or the sender is gone);
    nothing was touched and the old version serves on."""


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
    adapter: int | None = None  # LoRA: the adapter version this request runs on to its end


_warn_role = OncePerCause(log)  # a role no adapter serves: once per role

def engine_env(cfg: RolloutConfig) -> dict[str, str]:
    """The environment vLLM reads at engine start that comes from our settings."""
    return {"VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_cache_gib)} | (
        {"CUDA_VISIBLE_DEVICES": cfg.devices} if cfg.devices else {})


def _is(e: BaseException, name: str) -> bool:
    # vLLM's exceptions are matched by name, so this module imports vLLM only to start it
    return any(c.__name__ == name for c in type(e).__mro__)


def _vllm_request(prompt_ids: list[int], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    from vllm import SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(**kwargs, output_kind=RequestOutputKind.DELTA)
    return TokensPrompt(prompt_token_ids=prompt_ids), params


def transfer_backend(cuda: bool, shares_trainer_gpu: bool = False) -> TransferBackend:
    """vLLM weight-transfer backend: on GPU NCCL between hosts and CUDA IPC where a lent host's
    worker shares the trainer's GPUs; on CPU our gloo backend (vllm_ext.py)."""
    if not cuda:
        return "sf_gloo"
    return "ipc" if shares_trainer_gpu else "nccl"


def _build_llm(cfg: RolloutConfig) -> Any:
    from vllm.config import WeightTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(
        **engine_args(cfg),
        skip_tokenizer_init=True,
        disable_log_stats=True,
        worker_extension_cls=WORKER_EXTENSION,
        enable_sleep_mode=sleep_mode_available(),  # level-1 sleep needs vLLM's cumem allocator (GPU)
        **(dict(enable_lora=True, max_loras=cfg.max_loras, max_lora_rank=cfg.max_lora_rank) if cfg.lora else {}),
        weight_transfer_config=WeightTransferConfig(backend=transfer_backend(current_platform.is_cuda())),
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
        self.gpu_sleep = False  # sleep frees memory (vLLM sleep); else sleep is a pause
        self.kv_asleep = False  # staged wake: the weights are awake, the KV cache not yet (level 2)
        self.weights_gone = False  # a level-2 sleep discarded them: a load or a reload must fill them
        # where the version served now came from (a level-2 wake reloads it); None: it came over the
        # network and exists on no disk here, so after a level-2 sleep it must be received again
        self.served_path: str | None = cfg.model
        self.last_update: dict[str, float] = {}  # timings of the last in-place weight update
        self._llm = llm
        self._eos: list[int] = eos_token_ids(cfg.model)
        self._reference: TensorSpecs | None = None
        self._streams: dict[str, _Stream] = {}
        self._lock = asyncio.Lock()  # pause/resume/load, one at a time
        # LoRA hook: adapter versions beside the base (adapters.py); each request keeps its own
        self.adapters = AdapterTable(newest=self.version)
        self._unloads: set[asyncio.Task] = set()

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
        if self.cfg.start_asleep and self.gpu_sleep:  # a train host: the trainer's device memory back at once
            await self.sleep()

    def shutdown(self, timeout: float = 10.0) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown(timeout=timeout)
        # Dropping the last reference now lets AsyncLLM.__del__ run while the interpreter
        # is whole (at exit it raises "'NoneType' object is not callable").

    @property
    def running(self) -> int:
        return len(self._streams)

    @property
    def needs_refill(self) -> bool:
        """A level-2 sleep discarded weights that no path here holds: they must be received again."""
        return self.weights_gone and self.served_path is None

    def _weights_gone_error(self) -> WeightsGone:
        return WeightsGone(f"version {self.version} came over the network and the level-2 sleep discarded it: "
                           "no path to reload it from; it must be received again (sf.weights.fetch) before serving")

    # -- generation -----------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_ids: list[int], sampling: Sampling,
                       adapter: str = "") -> AsyncIterator[Delta]:
        """Deltas of one request; the last has `finish` set. Raises EngineError / EngineDead
        before the first delta if the request cannot start. `adapter`: the agent role whose
        adapter it runs on, where versions hold one per role (multi-LoRA)."""
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
        lora = self._take_adapter(stream, adapter) if self.cfg.lora else None
        self._streams[request_id] = stream
        stream.pump = asyncio.create_task(self._pump(request_id, prompt, params, stream, lora))
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
            if stream.adapter is not None:
                self._drop_adapter(stream.adapter)

    async def _pump(self, request_id: str, prompt: Any, params: Any, stream: _Stream, lora: Any = None) -> None:
        """Read vLLM's outputs as soon as they exist, so each is stamped with the version
        that produced it even while the consumer is busy sending the previous one."""
        last_token: int | None = None
        if stream.aborted or self.vacated:  # aborted or vacated before it reached vLLM
            stream.queue.put_nowait(_End("preempted", version=self.version))
            return
        try:
            lora_kw = {"lora_request": lora} if lora is not None else {}  # the full-weights path is unchanged
            async for out in self._llm.generate(prompt, params, request_id, **lora_kw):
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
                # an adapter request's tokens all come from its adapter; else from what is served now
                version = self.version if stream.adapter is None else stream.adapter
                if ids:
                    _stamp(stream.stamped, version, len(ids))
                    stream.queue.put_nowait(TokenDelta(request_id, ids, lps, version))
                if finish is not None:
                    stream.queue.put_nowait(_End(finish, version=version))
                if out.finished:
                    if stream.adapter is None:  # vLLM's spans follow update_weight_version, not adapters
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
            if self.kv_asleep and self.needs_refill:  # never serve discarded weights; still vacated
                raise self._weights_gone_error()
            # cleared before the await: a vacate that comes meanwhile must stay in force
            self.vacated = False
            await self._finish_wake(loaded=False)
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
            if self.gpu_sleep and self.kv_asleep:  # half awake (weights only): put the weights back to sleep
                await self._llm.sleep(level=self.cfg.sleep_level, mode=mode)
                self.kv_asleep = False
                self.weights_gone = self.weights_gone or self.cfg.sleep_level == 2
            elif self.gpu_sleep:
                await self._llm.sleep(level=self.cfg.sleep_level, mode=mode)
                self.weights_gone = self.cfg.sleep_level == 2
            else:  # CPU: nothing to free; pausing the scheduler is all sleep would do
                await self._llm.pause_generation(mode=mode, clear_cache=False)
            self.sleeping = True

    async def wake(self) -> None:
        """Undo `sleep`. A vacated engine stays vacated (no requests) until `resume`. After a level-2
        sleep of network-received weights the engine then `needs_refill`: the caller receives them."""
        async with self._lock:
            if self.dead:
                raise EngineDead(self.dead)
            if not self.sleeping:
                return
            if self.gpu_sleep and self.weights_gone:
                # staged: weight memory now, the KV cache after the update that fills it
                await self._llm.wake_up(tags=["weights"])
                self.kv_asleep = True
                if self.needs_refill:
                    log.info("awake without weights: version %d came over the network and must be received again",
                             self.version)
            elif self.gpu_sleep:
                await self._llm.wake_up()
            else:
                await self._llm.resume_generation()
            self.sleeping = False

    async def _finish_wake(self, loaded: bool) -> None:
        """The last stage of a staged wake (the caller holds `_lock`): refill the weights if no update
        did (the version served before the sleep), then `wake_up(["kv_cache"])`."""
        if not self.kv_asleep:
            return
        if self.weights_gone and not loaded:
            if self.served_path is None:
                raise self._weights_gone_error()
            rpc = self._llm.collective_rpc("reload_weights_in_place", kwargs={"weights_path": self.served_path})
            await asyncio.wait_for(rpc, RELOAD_TIMEOUT)
        self.weights_gone = False
        await self._llm.wake_up(tags=["kv_cache"])
        self.kv_asleep = False

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
            if is_adapter_version(path):  # LoRA hook: beside the others, no pause (one adapter, or one per role)
                if not self.cfg.lora:  # a full reload from an adapter dir would leave the engine dead
                    raise CheckpointError(f"{path} is a LoRA adapter; this worker serves full weights only "
                                          "(start it with SF_ROLLOUT_LORA=1)")
                await self._load_adapter(str(path), version)
                return
            self.updating = True
            t0 = time.perf_counter()
            try:
                # 2. freeze requests (their KV cache is dropped and recomputed with the new weights)
                await self._freeze()
                t1 = time.perf_counter()
                # 3. reload; a failure here leaves vLLM with half-loaded weights: never resume
                try:
                    # vllm_ext: vLLM's reload_weights, plus a repack of the tied LM head
                    rpc = self._llm.collective_rpc("reload_weights_in_place", kwargs={"weights_path": str(path)})
                    repacked = await asyncio.wait_for(rpc, RELOAD_TIMEOUT)
                except BaseException as e:
                    self._fail_midway(f"reload of {path}", e)
                log.info("reloaded %s (repacked layers per worker: %s)", path, repacked)
                self.served_path = str(path)
                self.weights_gone = False
                await self._finish_wake(loaded=True)  # a staged wake: the KV cache only now
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

    # -- LoRA: adapter versions (adapters.py) -----------------------------------------------

    def _take_adapter(self, stream: _Stream, role: str = "") -> Any:
        """The newest version for a new request, and its LoRARequest (None: the base). A multi-LoRA
        version serves the request's role's adapter; a role it has none for runs on the base (and the
        trainer dead-letters its trajectory: no adapter would train on it)."""
        stream.adapter = self.adapters.acquire()
        found = self.adapters.adapter(stream.adapter, role)
        if found is None:
            if stream.adapter in self.adapters.roles:
                _warn_role(f"role:{role}", "requests of role %r run on the base model: version %d has adapters "
                         "for roles %s only", role, stream.adapter, list(self.adapters.roles[stream.adapter]))
            return None
        from vllm.lora.request import LoRARequest

        lid, path = found
        return LoRARequest(f"v{stream.adapter}" + (f"-{role}" if role and lid != lora_id(stream.adapter) else ""),
                           lid, path)

    def _drop_adapter(self, version: int) -> None:
        self.adapters.release(version)
        if self.adapters.unloadable() and not self.dead:
            task = asyncio.create_task(self._unload_idle())
            self._unloads.add(task)
            task.add_done_callback(self._unloads.discard)

    async def _unload_idle(self) -> None:
        for v in self.adapters.unloadable():
            ids = self.adapters.ids(v)
            self.adapters.remove(v)
            for lid in ids:
                try:
                    await self._llm.remove_lora(lid)
                except Exception as e:  # a leftover adapter only costs memory; the next unload tries again
                    log.warning("unloading adapter v%d (id %d): %s", v, lid, e)

    async def _load_adapter(self, path: str, version: int) -> None:
        """Add version `version`'s adapter while the engine runs: requests in flight keep theirs
        (within max_staleness; older ones are aborted and resume on the newest through partial
        rollout), new requests take this one, idle older adapters are unloaded."""
        from vllm.lora.request import LoRARequest

        from shared.adapters import adapter_rank, role_adapters

        roles = role_adapters(path)  # multi-LoRA: one adapter per role, all loaded with the version
        dirs = {role: str(d) for role, d in roles.items()} or {"": path}
        for d in dirs.values():
            if (rank := adapter_rank(d)) > self.cfg.max_lora_rank:
                raise CheckpointError(f"{d}: rank {rank} is above max_lora_rank={self.cfg.max_lora_rank}")
        t0 = time.perf_counter()
        for slot, (role, d) in enumerate(sorted(dirs.items())):
            lid = lora_id(version, slot) if roles else lora_id(version)
            if not await self._llm.add_lora(LoRARequest(f"v{version}" + (f"-{role}" if role else ""), lid, d)):
                raise CheckpointError(f"vLLM refused the adapter {d}")
        t1 = time.perf_counter()
        self.adapters.add(version, path, tuple(roles))
        self.version = version
        stale = set(self.adapters.stale(self.cfg.max_staleness))
        migrated = [rid for rid, s in list(self._streams.items()) if s.adapter in stale]
        for rid in migrated:
            await self.abort(rid)
        await self._unload_idle()
        self.last_update = {"version": version, "pause_ms": 0.0, "load_ms": 1000 * (t1 - t0),
                            "resume_ms": 0.0, "migrated": float(len(migrated)), "adapters": float(len(self.adapters.paths))}
        log.info("adapter v%d added in %.1f ms (no pause); %d requests migrated, %d adapters loaded", version,
                 1000 * (t1 - t0), len(migrated), len(self.adapters.paths))

    async def receive_weights(self, transfer: WeightTransfer, version: int) -> None:
        """Pause in keep mode, receive `version` over the network through vLLM's weight-transfer
        API (join the round, start, update, finish with the version), resume.

        Raises TransferMissed (could not join: nothing touched, still serving the old version),
        EngineDead (the receive failed halfway) or EngineAsleep (nothing touched)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest

        async with self._lock:
            if self.dead:
                raise EngineDead(self.dead)
            if self.sleeping:
                raise EngineAsleep(f"not receiving version {version} into a sleeping engine; wake it first")
            self.updating = True
            t0 = time.perf_counter()
            try:
                # 1. freeze requests, as for a reload from disk
                await self._freeze()
                t1 = time.perf_counter()
                # 2. join the round; a miss leaves the weights untouched
                init = {"address": transfer.address, "port": transfer.port, "group": transfer.group,
                        "timeout": JOIN_TIMEOUT}
                try:
                    await asyncio.wait_for(self._llm.init_weight_transfer_engine(
                        WeightTransferInitRequest(init_info=init)), JOIN_TIMEOUT + 5)
                except Exception as e:
                    if not self.vacated and not self.kv_asleep:  # a staged wake has no weights to serve yet
                        await self._llm.resume_generation()
                    raise TransferMissed(f"round {transfer.group} at {transfer.address}:{transfer.port}: "
                                         f"{type(e).__name__}: {e}") from e
                t2 = time.perf_counter()
                # 3. receive into the model; a failure here leaves half-loaded weights: never resume
                try:
                    await self._llm.start_weight_update()
                    await asyncio.wait_for(self._llm.update_weights(
                        WeightTransferUpdateRequest(update_info={"version": version})), RELOAD_TIMEOUT)
                    # 4. tokens sampled from here on come from `version`
                    await self._llm.finish_weight_update(weight_version=str(version))
                except BaseException as e:
                    self._fail_midway(f"receive of version {version}", e)
                self.served_path = None  # on no disk here: a level-2 wake must receive it again
                self.weights_gone = False
                await self._finish_wake(loaded=True)  # a staged wake: the KV cache only now
                t3 = time.perf_counter()
                self.version = version
                if not self.vacated:
                    await self._llm.resume_generation()
                t4 = time.perf_counter()
                self.last_update = {"version": version, "pause_ms": 1000 * (t1 - t0), "join_ms": 1000 * (t2 - t1),
                                    "load_ms": 1000 * (t3 - t2), "resume_ms": 1000 * (t4 - t3)}
                log.info("weight update v%d over %s: pause %.1f ms, join %.1f ms, receive %.1f ms, resume %.1f ms",
                         version, transfer.backend,
                         *(self.last_update[k] for k in ("pause_ms", "join_ms", "load_ms", "resume_ms")))
            finally:
                self.updating = False

    async def _freeze(self) -> None:
        """Pause in keep mode for a weight update: requests stay, their KV cache is dropped (it is
        recomputed with the new weights), and the steps under way settle."""
        await self._llm.pause_generation(mode="keep", clear_cache=True)
        await asyncio.sleep(SETTLE_SECONDS)

    def _fail_midway(self, what: str, e: BaseException) -> NoReturn:
        """An update failed after the weights began to change: the engine is dead and never resumes."""
        self._mark_dead(f"{what} failed: {type(e).__name__}: {e}")
        if isinstance(e, asyncio.CancelledError):
            raise e
        raise EngineDead(self.dead) from e

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
