"""Rollout worker settings, from SF_ROLLOUT_* (connections come from SF_NATS_*).

    SF_ROLLOUT_MODEL=var/model SF_ROLLOUT_WORKER_ID=w0 python -m services.rollout

The defaults run one tiny model on a laptop CPU. On a GPU set dtype=bfloat16,
enforce_eager=false and a larger max_num_seqs; the vLLM engine arguments below
(tensor_parallel_size, gpu_memory_utilization, max_num_batched_tokens, devices) pass
through to `AsyncEngineArgs` / the engine's environment unchanged.

Sleep (a lent train host's worker between lends): level 2 discards the weights and the
KV cache (nothing copied to host memory); the wake is staged - `wake_up(["weights"])`,
then the weight update, then `wake_up(["kv_cache"])` - so the old weights are never copied
back only to be overwritten. That path needs vLLM's sleep mode, which the installed vLLM
has on CUDA/ROCm/XPU only; on CPU sleep is a pause that frees nothing (engine.py).
"""

from __future__ import annotations

import os
import re
import socket
from typing import Literal

import msgspec

from shared import timeouts, weightstore
from shared.config import ConfigError, load

_SUBJECT_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")
# immediate: pause (keep), load, resume; drain: hold new requests, let in-flight ones finish, then load
UpdatePolicy = Literal["immediate", "drain"]


class RolloutConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: str  # HF checkpoint dir that vLLM loads; its weights are version `initial_version`
    worker_id: str = ""  # one NATS subject token; "" = "<hostname>-<pid>"
    served_model_name: str = ""  # reported in heartbeats; "" = the model dir's name
    max_model_len: int = 2048
    max_num_seqs: int = 16  # reported as capacity
    kv_cache_gib: int = 1  # sets VLLM_CPU_KVCACHE_SPACE for the engine (vLLM-CPU's KV cache size)
    enforce_eager: bool = True
    dtype: str = "float32"
    # vLLM engine arguments (GPU); 0 / "" = vLLM's own default
    tensor_parallel_size: int = 1  # GPUs one engine shards the model over
    gpu_memory_utilization: float = 0.9  # share of each GPU's memory vLLM takes (weights + KV cache)
    max_num_batched_tokens: int = 0  # tokens per scheduler step
    devices: str = ""  # CUDA_VISIBLE_DEVICES for the engine, e.g. "4,5,6,7"; "" = inherited
    sleep_level: int = 2  # 1 = weights kept in host memory while asleep; 2 = discarded, reloaded on wake
    start_asleep: bool = False  # sleep right after start (the host agent sets it on a train host)
    seed: int = 0
    status_interval: float = timeouts.HEARTBEAT_INTERVAL  # seconds between heartbeats
    max_request_seconds: float = 600.0  # hard bound on one Generate
    host: str = ""  # capability/host name reported to the scheduler
    # following WeightsPublished (the WEIGHTS stream's last value)
    follow_weights: bool = True
    update_policy: UpdatePolicy = "immediate"
    weights_poll: float = 5.0  # seconds between checks of the newest version besides the push
    drain_timeout: float = 30.0  # seconds a drain waits for in-flight requests before loading anyway
    # under the tag scheduler: its host agent starts the resident worker with start_vacated
    start_vacated: bool = False  # take no work until a resume (the scheduler's assignment); default: serve at once
    initial_version: int = -1  # the version `model` holds; -1 = its weight-store dir's (v000007 -> 7), else 0
    # LoRA (services/rollout/adapters.py): versions that are adapter dirs load beside the base, no pause
    lora: bool = False  # start vLLM with enable_lora (needed to serve a LoRA trainer's versions)
    max_loras: int = 4  # adapters one batch may mix (vLLM max_loras); at least max_staleness + 2
    max_lora_rank: int = 16  # the largest adapter rank accepted (vLLM max_lora_rank)
    max_staleness: int = 2  # a request more versions behind the newest adapter migrates (partial rollout); -1 = never
    # Prometheus /metrics (sf_bus_malformed_total); 0 = off (workers on one machine need a port each)
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"


def default_worker_id() -> str:
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname()) or "host"
    return f"{host}-{os.getpid()}"


def load_config(**overrides) -> RolloutConfig:
    """SF_ROLLOUT_* plus overrides (CLI flags); fills in the worker id and checks it."""
    cfg = load(RolloutConfig, "SF_ROLLOUT_", **overrides)
    if not cfg.model:
        raise ConfigError("SF_ROLLOUT_MODEL (or --model) is required")
    if not cfg.worker_id:
        cfg = msgspec.structs.replace(cfg, worker_id=default_worker_id())
    if not _SUBJECT_TOKEN.match(cfg.worker_id):
        raise ConfigError(f"worker id {cfg.worker_id!r} must be one NATS subject token: [A-Za-z0-9_-]+")
    if cfg.max_model_len < 2 or cfg.max_num_seqs < 1 or cfg.status_interval <= 0 or cfg.max_request_seconds <= 0:
        raise ConfigError(f"bad rollout limits: {cfg}")
    if cfg.lora and cfg.max_staleness >= 0 and cfg.max_loras < cfg.max_staleness + 2:
        raise ConfigError(f"max_loras={cfg.max_loras} cannot hold the adapters in flight within max_staleness="
                          f"{cfg.max_staleness} plus the newest ({cfg.max_staleness + 2})")
    if cfg.tensor_parallel_size < 1 or not 0 < cfg.gpu_memory_utilization <= 1 or cfg.max_num_batched_tokens < 0:
        raise ConfigError("tensor_parallel_size must be >= 1, gpu_memory_utilization in (0, 1], "
                          "max_num_batched_tokens >= 0")
    if cfg.sleep_level not in (1, 2):
        raise ConfigError("sleep_level must be 1 or 2")
    if cfg.devices and len(cfg.devices.split(",")) < cfg.tensor_parallel_size:
        raise ConfigError(f"devices {cfg.devices!r} name fewer GPUs than tensor_parallel_size="
                          f"{cfg.tensor_parallel_size}")
    return cfg


def engine_args(cfg: RolloutConfig) -> dict:
    """The keyword arguments of vLLM's `AsyncEngineArgs` that come from our settings (no defaults forced)."""
    args = dict(model=cfg.model, dtype=cfg.dtype, enforce_eager=cfg.enforce_eager, max_model_len=cfg.max_model_len,
                max_num_seqs=cfg.max_num_seqs, seed=cfg.seed, tensor_parallel_size=cfg.tensor_parallel_size,
                gpu_memory_utilization=cfg.gpu_memory_utilization)
    if cfg.max_num_batched_tokens:
        args["max_num_batched_tokens"] = cfg.max_num_batched_tokens
    return args


def served_name(cfg: RolloutConfig) -> str:
    return cfg.served_model_name or os.path.basename(os.path.normpath(cfg.model))


def initial_version(cfg: RolloutConfig) -> int:
    """The weight version the worker starts at: `initial_version` if set, else the number of a
    weight-store dir (`<store>/v000007` -> 7), else 0 (a base checkpoint)."""
    if cfg.initial_version >= 0:
        return cfg.initial_version
    v = weightstore.version_of(os.path.normpath(cfg.model))
    return 0 if v is None else v
