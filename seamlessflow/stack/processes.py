"""The whole stack on one machine, as child processes: nats-server, redis-server, trajectory
manager(s), rollout worker(s) and the gateway. Used by `seamlessflow up`, the demo, the
end-to-end tests and the benchmarks.

Each service logs to DATA_DIR/logs/<name>.log; start() waits for each one's ready line
with a timeout and, if one fails, stops the others and shows the tail of its log.
`start(wait=False)` only spawns, for `seamlessflow up`, whose keeper (keeper.py) watches
readiness and restarts; `respawn` starts a process again with the same command and
environment; `stop` stops in tiers (supervisor.shutdown_tiers) and leaves no process of a
service's group behind.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from seamlessflow.stack import servers
from seamlessflow.stack import tls as stack_tls
from seamlessflow.stack.pinning import PinPlan, cpu_list, pin_plan
from seamlessflow.stack.supervisor import shutdown_tiers

ENGINE_ENV = {  # not VLLM_CPU_KVCACHE_SPACE: the rollout worker sets it from SF_ROLLOUT_KV_CACHE_GIB
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "DS_ACCELERATOR": "cpu",
}


# torch.distributed's rendezvous variables: a stack's services never inherit them (Stack.env)
DIST_ENV = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                      "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"})


def compile_caches(env: dict[str, str]) -> dict[str, str]:
    """Where vLLM's compiled graphs, inductor's kernels and DeepSpeed's JIT-built ops go: one cache
    shared by every stack of this user (`SF_CACHE_DIR`, default ~/.cache/seamlessflow), not one per
    data dir, so a second demo with another `--data-dir` does not compile them again. Each library
    keys its entries by what built them, as it does in its own default location."""
    root = Path(env.get("SF_CACHE_DIR") or Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "seamlessflow")
    return {"VLLM_CACHE_ROOT": str(root / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
            "TORCH_EXTENSIONS_DIR": str(root / "torch_extensions")}


STALE_BUILD_LOCK_S = 600  # a DeepSpeed op build takes well under a minute on 2 cores


def clear_stale_build_locks(root: Path, now: float) -> list[Path]:
    """A process killed while DeepSpeed JIT-builds an op (a demo stopped with Ctrl-C in its first
    seconds, a crash test's trainer) leaves the build's `lock` file behind, and every later build in
    that cache waits on it forever. Locks older than any real build are removed before a start."""
    removed = []
    for lock in root.glob("*/lock"):
        try:
            if now - lock.stat().st_mtime > STALE_BUILD_LOCK_S:
                lock.unlink()
                removed.append(lock)
        except FileNotFoundError:
            pass
    return removed


def venv_first(path: str) -> str:
    """PATH with this interpreter's bin first: DeepSpeed builds its ops with the first `ninja` on PATH,
    and a build by another ninja version looks stale to it (the .ninja_log hash changed in 1.12), so
    every service builds with the venv's and reuses what another built."""
    venv_bin = str(Path(sys.executable).parent)
    parts = [p for p in path.split(os.pathsep) if p and p != venv_bin]
    return os.pathsep.join([venv_bin, *parts])


class StackError(RuntimeError):
    pass


@dataclass
class StackOptions:
    model: Path
    data_dir: Path = Path("var")
    workers: int = 1
    trajectory_replicas: int = 1
    gateway_port: int = 8000
    admin_port: int = 8001
    nats_port: int = 14222
    redis_port: int = 16379
    served_model: str = "seamlessflow-tiny"
    max_model_len: int = 2048
    max_num_seqs: int = 16
    ready_timeout: float = 240.0
    external_nats: str = ""  # use this NATS (or cluster: seed URLs, comma-separated) instead of starting one
    external_redis: str = ""
    extra_env: dict[str, str] = field(default_factory=dict)
    # tag scheduling: with a policy, host agents (each with a resident worker) replace `workers`
    policy: str = ""  # "" | colocated | disaggregated | seamless
    hosts: list[str] = field(default_factory=list)  # tag sets, one per host: "train+rollout", "rollout"
    train: bool = False  # also run the DeepSpeed trainer: with a policy on the first train host, gated by the
    # scheduler; without one, as a process of its own beside the rollout workers
    trainer_settings: dict[str, str] = field(default_factory=dict)  # SF_TRAINER_<NAME> for --train
    # another command line for every rollout worker instead of `python -m services.rollout`
    # (e.g. `python -m services.rollout.simulated`, SIMULATED, for tests of supervision and benchmarks);
    # `--model MODEL --worker-id NAME` are appended. Host agents get it as SF_HOST_WORKER_CMD.
    worker_cmd: str = ""
    # with a policy: each host's agent, worker and trainer rank on a CPU set of its own, the control
    # plane on the rest (pinning.py says how fewer cores than hosts + 1 are shared)
    pin: bool = False
    # the NATS and Redis it starts speak only TLS and verify clients, with certificates from DATA_DIR/tls
    # (tls.py); every service gets SF_NATS_TLS_* / SF_REDIS_TLS_* (a server you give with external_* is yours)
    tls: bool = False


@dataclass(frozen=True)
class HostSpec:
    id: str
    tags: tuple[str, ...]
    cores: str = ""


def parse_hosts(spec: str | list[str]) -> list[str]:
    """`"train+rollout,rollout"` -> ["train+rollout", "rollout"]: one tag set per host."""
    items = spec.split(",") if isinstance(spec, str) else spec
    out = [i.strip() for i in items if i.strip()]
    for i in out:
        tags = set(i.split("+"))
        if not tags & {"train", "rollout"}:
            raise StackError(f"host {i!r} has no role: give it train and/or rollout (e.g. train+rollout)")
    return out


def host_specs(hosts: list[str], cpus: list[int]) -> list[HostSpec]:
    """host-0, host-1, ... with their tags (plus `cpu`, unless a hardware tag is given) and
    disjoint core sets for their rollout workers."""
    cores = split_cpus(cpus, len(hosts))
    specs = []
    for i, h in enumerate(hosts):
        name, _, tagstr = h.rpartition("=")
        tags = tuple(t for t in tagstr.split("+") if t)
        if not any(t not in ("train", "rollout") for t in tags):
            tags += ("cpu",)
        specs.append(HostSpec(name or f"host-{i}", tags, cores[i] if i < len(cores) else ""))
    return specs


def split_cpus(cpus: list[int], n: int) -> list[str]:
    """vLLM-CPU binding masks (VLLM_CPU_OMP_THREADS_BIND) for n engines on one host: disjoint
    core sets when there are enough cores, else one core each, round robin. vLLM's own "auto"
    binds every engine to the same first core, so two engines would share one core."""
    cpus = sorted(cpus)
    if n <= 0 or not cpus:
        return []
    if len(cpus) < n:
        return [str(cpus[i % len(cpus)]) for i in range(n)]
    per = len(cpus) // n
    return [",".join(map(str, cpus[i * per:(i + 1) * per])) for i in range(n)]


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    ready: str = ""  # the log line that says it is serving
    offset: int = 0  # where this run's log starts
    argv: list[str] = field(default_factory=list)  # to start it again (respawn)
    env: dict[str, str] | None = None
    port: int = 0  # serving once this port listens (NATS, Redis: no ready line)


def strip_login(url: str) -> str:
    """`scheme://user:pass@host...` -> `scheme://host...`."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rsplit('@', 1)[-1]}" if sep else url


def client_env(data_dir: Path) -> dict[str, str]:
    """SF_NATS_URL and SF_REDIS_URL, with the credentials (and with --tls the SF_*_TLS_* files), of the
    stack `seamlessflow up` runs from `data_dir` (stack.json has the URLs, credentials.json the logins);
    {} if none runs there."""
    try:
        stack = json.loads((data_dir / "stack.json").read_text())
    except (OSError, ValueError):
        return {}
    try:
        creds = json.loads((data_dir / "credentials.json").read_text())
    except (OSError, ValueError):
        creds = {}
    nats_url, redis_url = stack.get("nats_url", ""), stack.get("redis_url", "")
    if stack.get("nats_login") and creds.get("nats_password"):  # a NATS the stack started
        nats_url = nats_url.replace("://", f"://{creds['nats_user']}:{creds['nats_password']}@", 1)
    if stack.get("redis_login") and creds.get("redis_password"):
        redis_url = redis_url.replace("://", f"://:{creds['redis_password']}@", 1)
    if not nats_url:
        return {}
    env = {"SF_NATS_URL": nats_url, "SF_REDIS_URL": redis_url}
    if stack.get("tls_dir"):  # up --tls: the files' paths (the keys stay in their 0600 files)
        env |= stack_tls.TlsFiles(Path(stack["tls_dir"])).settings(bool(stack.get("nats_tls")),
                                                                   bool(stack.get("redis_tls")))
    return env


class Stack:
    def __init__(self, opts: StackOptions):
        self.o = opts
        self.data = opts.data_dir.resolve()
        self.logs = self.data / "logs"
        self.procs: list[Proc] = []
        self.api_key = ""
        self.admin_key = ""
        # NATS and Redis that this stack starts require these (generated, kept in credentials.json);
        # empty until `up` reads them, and unused with external_nats / external_redis
        self.nats_user = ""
        self.nats_password = ""
        self.redis_password = ""
        # the trainer's Prometheus port, which the gateway's status page scrapes: one per stack
        # (a fixed 9401 would let two stacks on one machine read each other's trainer)
        self.trainer_metrics_port = 0
        self.metrics_urls: dict[str, str] = {}  # process name -> its Prometheus /metrics (stack.json "metrics")
        self.pins: dict[str, tuple[int, ...]] = {}  # process name -> its CPU set (--pin); others: the control set
        self.control_cpus: tuple[int, ...] = ()  # () = not pinned
        self.tls: stack_tls.TlsFiles | None = None  # with --tls: made (or found) by start()

    # -- public -----------------------------------------------------------------------------------

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.o.gateway_port}/v1"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.o.admin_port}"

    @property
    def nats_url(self) -> str:
        """With the credentials in it: what this process and the services it starts connect with
        (never logged or written: stack.json and messages show `public_urls()`)."""
        login = f"{self.nats_user}:{self.nats_password}@" if self.nats_password else ""
        return self.o.external_nats or f"{'tls' if self.o.tls else 'nats'}://{login}127.0.0.1:{self.o.nats_port}"

    @property
    def redis_url(self) -> str:
        login = f":{self.redis_password}@" if self.redis_password else ""
        return self.o.external_redis or f"{'rediss' if self.o.tls else 'redis'}://{login}127.0.0.1:{self.o.redis_port}/0"

    def public_urls(self) -> dict[str, str | bool]:
        """The NATS and Redis URLs without credentials, whether they need the stack's logins and its TLS
        files (stack.json; `client_env` adds the logins back from credentials.json, the files from tls_dir)."""
        return {"nats_url": strip_login(self.nats_url), "redis_url": strip_login(self.redis_url),
                "nats_login": not self.o.external_nats and bool(self.nats_password),
                "redis_login": not self.o.external_redis and bool(self.redis_password),
                "nats_tls": self.o.tls and not self.o.external_nats, "redis_tls": self.o.tls and not self.o.external_redis,
                "tls_dir": str(self.data / "tls") if self.o.tls else ""}

    def client_settings(self) -> dict[str, str]:
        """What a client of this stack's NATS and Redis needs: the URLs with the logins, and with --tls
        the SF_*_TLS_* files (paths) for the servers it starts."""
        out = {"SF_NATS_URL": self.nats_url, "SF_REDIS_URL": self.redis_url}
        if self.tls is not None:
            out |= self.tls.settings(nats=not self.o.external_nats, redis=not self.o.external_redis)
        return out

    def running_elsewhere(self) -> str | None:
        """A message if another stack already holds this data dir or these ports."""
        pidfile = self.data / "stack.pid"
        if pidfile.exists():
            try:
                pid = int(pidfile.read_text())
                os.kill(pid, 0)
                return f"a SeamlessFlow stack (pid {pid}) is already running with data dir {self.data}"
            except (ValueError, ProcessLookupError, PermissionError):
                pass
        ports = [(self.o.gateway_port, "gateway"), (self.o.admin_port, "admin")]
        if not self.o.external_nats:
            ports.append((self.o.nats_port, "NATS"))
        if not self.o.external_redis:
            ports.append((self.o.redis_port, "Redis"))
        for port, what in ports:
            if servers.port_open(port):
                return f"port {port} ({what}) is already in use; is a stack running? choose other ports with --{what.lower()}-port"
        return None

    def start(self, wait: bool = True) -> None:
        """Start every service; with `wait`, until each is ready (StackError if one is not)."""
        busy = self.running_elsewhere()
        if busy:
            raise StackError(busy)
        self.logs.mkdir(parents=True, exist_ok=True)
        (self.data / "stack.pid").write_text(str(os.getpid()))
        self._credentials()
        self._certificates()
        clear_stale_build_locks(Path(self.env()["TORCH_EXTENSIONS_DIR"]), time.time())
        self.trainer_metrics_port = servers.free_port()
        specs = host_specs(self.o.hosts, list(os.sched_getaffinity(0))) if self.o.policy else []
        if self.o.pin and specs:
            specs = self._pin(specs, pin_plan(list(os.sched_getaffinity(0)), len(specs)))
        state = {**self.public_urls(), "gateway_url": self.gateway_url,
                 "admin_url": self.admin_url, "weights_dir": str(self.weights_dir), "policy": self.o.policy,
                 "hosts": [{"id": h.id, "tags": list(h.tags), "cores": h.cores} for h in specs],
                 "control_cpus": cpu_list(self.control_cpus)}
        (self.data / "stack.json").write_text(json.dumps(state))
        try:
            self._spawn_infra()
            for i in range(self.o.trajectory_replicas):
                self.spawn_trajectory(f"trajectory-{i}")
            if self.o.policy:
                self.spawn_scheduler()
                for h in specs:
                    self.spawn_host(h)
                trainer_host = next((h for h in specs if "train" in h.tags), None)
                if self.o.train and trainer_host is not None:
                    if trainer_host.id in self.pins:  # its rank runs on its host's cores
                        self.pins["trainer"] = self.pins[trainer_host.id]
                    self.spawn_trainer(host=trainer_host.id, scheduler_gate="true", **self.o.trainer_settings)
            else:
                for i in range(self.o.workers):
                    self.spawn_rollout(f"rollout-{i}")
                if self.o.train:  # no scheduler: the trainer trains whenever a batch is ready
                    self.spawn_trainer(**self.o.trainer_settings)
            self._spawn_gateway()
            (self.data / "stack.json").write_text(json.dumps({**state, "metrics": self.metrics_urls}))
            for p in self.procs if wait else ():
                self._wait_ready(p)
        except BaseException:
            self.stop()
            raise

    def stop(self, say=lambda msg: None, timeout: float = 30.0) -> None:
        """Stop in tiers: the gateway, then the trajectory replicas (they drain while the workers
        still serve), then workers, host agents, trainer and scheduler, then Redis and NATS.
        Each tier gets SIGTERM and `timeout` seconds, then SIGKILL; whatever is left of each
        process group is killed."""
        by_name = {p.name: p for p in self.procs}
        for tier in shutdown_tiers(list(by_name)):
            live = [n for n in tier if by_name[n].popen.poll() is None]
            if live:
                say(f"stopping {', '.join(live)} ...")
            self.terminate([by_name[n] for n in tier], timeout)
        self.procs.clear()
        (self.data / "stack.pid").unlink(missing_ok=True)
        (self.data / "stack.json").unlink(missing_ok=True)

    def env(self) -> dict[str, str]:
        # a service is its own process group: a rank this process holds (torchrun, or an in-process
        # trainer in a test) must not leak into it (extra_env may still set one)
        env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
        for k, v in ENGINE_ENV.items():
            env.setdefault(k, v)
        for key, path in compile_caches(env).items():
            env.setdefault(key, path)
        env["PATH"] = venv_first(env.get("PATH", ""))
        env.update(self.client_settings(), SF_WEIGHTS_DIR=str(self.weights_dir))
        env.update(self.o.extra_env)
        if env.get("SF_TRAINER_LORA_RANK", "0").strip() not in ("", "0"):  # a LoRA trainer publishes adapters:
            env.setdefault("SF_ROLLOUT_LORA", "1")  # its stack's workers serve them (docs/architecture.md)
        return env

    def spawn_trajectory(self, name: str) -> Proc:
        env = self.env() | {"SF_TRAJECTORY_MAX_MODEL_LEN": str(self.o.max_model_len)}
        self._metrics(name, env, "SF_TRAJECTORY_METRICS_PORT")
        return self._spawn(name, [sys.executable, "-m", "services.trajectory", "--model", str(self.o.model)],
                           env, ready="trajectory manager ready")

    def spawn_rollout(self, name: str) -> Proc:
        env = self.env() | {
            "SF_ROLLOUT_SERVED_MODEL_NAME": self.o.served_model,
            "SF_ROLLOUT_MAX_MODEL_LEN": str(self.o.max_model_len),
            "SF_ROLLOUT_MAX_NUM_SEQS": str(self.o.max_num_seqs),
        }
        if self.o.workers > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in env:
            index = int(name.rsplit("-", 1)[-1])
            env["VLLM_CPU_OMP_THREADS_BIND"] = split_cpus(list(os.sched_getaffinity(0)), self.o.workers)[index]
        self._metrics(name, env, "SF_ROLLOUT_METRICS_PORT")
        cmd = shlex.split(self.o.worker_cmd) if self.o.worker_cmd else [sys.executable, "-m", "services.rollout"]
        return self._spawn(name, [*cmd, "--model", str(self.o.model), "--worker-id", name], env,
                           ready=f"rollout worker {name} ready")

    def spawn_trainer(self, name: str = "trainer", model: Path | None = None, **settings: object) -> Proc:
        """The DeepSpeed trainer; `settings` become SF_TRAINER_<NAME> variables."""
        env = self.env() | {f"SF_TRAINER_{k.upper()}": str(v) for k, v in settings.items()}
        env.setdefault("SF_TRAINER_METRICS_PORT", str(self.trainer_metrics_port))
        self.metrics_urls[name] = f"http://127.0.0.1:{env['SF_TRAINER_METRICS_PORT']}/metrics"
        env.setdefault("SF_TRAINER_TENSORBOARD_DIR", str(self.data / "trainer" / "tb"))
        env.setdefault("SF_TRAINER_AUDIT_LOG", str(self.data / "trainer" / "trained.jsonl"))
        env.setdefault("OMP_NUM_THREADS", "1")
        return self._spawn(name, [sys.executable, "-m", "services.trainer", "--model", str(model or self.o.model),
                                  "--checkpoint-dir", str(self.data / "trainer" / "checkpoints"),
                                  "--weights-dir", str(self.weights_dir)], env, ready="trainer ready")

    def spawn_scheduler(self, name: str = "scheduler") -> Proc:
        env = self.env() | {"SF_SCHEDULER_POLICY": self.o.policy}
        self._metrics(name, env, "SF_SCHEDULER_METRICS_PORT")
        return self._spawn(name, [sys.executable, "-m", "services.scheduler"], env, ready="scheduler ready")

    def spawn_host(self, h: HostSpec) -> Proc:
        """A host agent; its resident rollout worker (if tagged rollout) logs to logs/<id>-rollout.log."""
        env = self.env() | {
            "SF_HOST_ID": h.id, "SF_HOST_TAGS": ",".join(h.tags), "SF_HOST_CORES": h.cores,
            "SF_HOST_CPUS": cpu_list(self.pins.get(h.id, ())),
            "SF_HOST_LOG_DIR": str(self.logs), "SF_HOST_TRAINER": str(self.o.train and "train" in h.tags).lower(),
            "SF_ROLLOUT_SERVED_MODEL_NAME": self.o.served_model,
            "SF_ROLLOUT_MAX_MODEL_LEN": str(self.o.max_model_len),
            "SF_ROLLOUT_MAX_NUM_SEQS": str(self.o.max_num_seqs),
        }
        if "rollout" in h.tags:
            env["SF_HOST_MODEL"] = str(self.o.model)
        if self.o.worker_cmd:
            env["SF_HOST_WORKER_CMD"] = self.o.worker_cmd
        self._metrics(h.id, env, "SF_HOST_METRICS_PORT")
        return self._spawn(h.id, [sys.executable, "-m", "services.scheduler.host"], env,
                           ready=f"host agent {h.id} ready")

    @property
    def weights_dir(self) -> Path:
        return self.data / "weights"

    def spawn(self, name: str, argv: list[str], ready: str) -> Proc:
        """Start any process with the stack's environment (for benchmarks and tests)."""
        return self._spawn(name, argv, self.env(), ready=ready)

    def terminate(self, procs: list[Proc], timeout: float = 30.0) -> None:
        """SIGTERM to each process group, wait for all (at most `timeout`), SIGKILL the rest."""
        for p in procs:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.popen.wait(10)
            self.clear_group(p)

    def clear_group(self, p: Proc) -> None:
        """Kill what is left of an exited process's group (e.g. a SIGKILLed worker's vLLM engine
        process). Its group id stays reserved while any member lives, so this hits no stranger."""
        _signal_group(p, signal.SIGKILL)

    def respawn(self, p: Proc) -> Proc:
        """Start an exited service again, with the same command and environment."""
        self.clear_group(p)
        at = self.procs.index(p) if p in self.procs else len(self.procs)
        if p in self.procs:
            self.procs.remove(p)
        new = self._spawn(p.name, p.argv, p.env, ready=p.ready, log=p.log, port=p.port)
        self.procs.insert(at, self.procs.pop())  # its old place: start order is stop order within a tier
        return new

    def is_ready(self, p: Proc) -> bool:
        """Has this run of `p` said it serves (its ready line, or its port listening)?"""
        if p.port:
            return servers.port_open(p.port)
        if not p.ready:
            return True
        with open(p.log, "rb") as f:
            f.seek(p.offset)
            return p.ready.encode() in f.read()

    def kill(self, name: str, sig: int = 9) -> None:
        """Send `sig` to one service (SIGKILL by default) and forget it."""
        for p in list(self.procs):
            if p.name == name:
                try:
                    os.killpg(p.popen.pid, sig)
                except ProcessLookupError:
                    pass
                p.popen.wait(30)
                self.procs.remove(p)

    def wait_ready(self, proc: Proc) -> None:
        self._wait_ready(proc)

    # -- internals --------------------------------------------------------------------------------

    def _pin(self, specs: list[HostSpec], plan: PinPlan) -> list[HostSpec]:
        """Record the plan (hosts by id, the control plane's set); the hosts' vLLM binding follows their set."""
        self.control_cpus = plan.control
        self.pins = {h.id: cpus for h, cpus in zip(specs, plan.hosts, strict=True)}
        return [HostSpec(h.id, h.tags, ",".join(map(str, cpus))) for h, cpus in zip(specs, plan.hosts, strict=True)]

    def _credentials(self) -> None:
        """The stack's secrets, generated once, in DATA_DIR/credentials.json (0600): the API and admin
        keys, and the logins of the NATS and Redis it starts (added to an older file that lacks them)."""
        path = self.data / "credentials.json"
        creds = json.loads(path.read_text()) if path.exists() else {}
        fresh = {"api_key": "sk-sf-" + secrets.token_urlsafe(24), "admin_key": "sk-sf-admin-" + secrets.token_urlsafe(24),
                 "nats_user": "seamlessflow", "nats_password": secrets.token_urlsafe(24),
                 "redis_password": secrets.token_urlsafe(24)}
        if set(fresh) - set(creds):
            creds = fresh | creds
            path.touch(mode=0o600)
            os.chmod(path, 0o600)
            path.write_text(json.dumps(creds))
        self.api_key, self.admin_key = creds["api_key"], creds["admin_key"]
        self.nats_user, self.nats_password = creds["nats_user"], creds["nats_password"]
        self.redis_password = creds["redis_password"]

    def _certificates(self) -> None:
        """With --tls: the CA and certificates in DATA_DIR/tls, made on the first run, reused after."""
        if not self.o.tls:
            return
        if self.o.external_nats and self.o.external_redis:
            raise StackError("--tls secures the NATS and Redis the stack starts, and it starts neither: for "
                             "servers you run, give the services SF_NATS_TLS_* and SF_REDIS_TLS_* (docs/security.md)")
        try:
            self.tls = stack_tls.ensure(self.data / "tls")
        except stack_tls.TlsError as e:
            raise StackError(str(e)) from None

    def _spawn_infra(self) -> None:
        infra = []
        if not self.o.external_nats:
            argv = servers.nats_argv(self.o.nats_port, self.data / "nats", self.nats_user, self.nats_password,
                                     tls=self.tls)
            infra.append(self._spawn("nats", argv, None, ready="", port=self.o.nats_port))
        if not self.o.external_redis:
            argv = servers.redis_argv(self.o.redis_port, self.data / "redis", durable=True, password=self.redis_password,
                                      log_file=self.logs / "redis.log", tls=self.tls)
            infra.append(self._spawn("redis", argv, None, ready="", port=self.o.redis_port))
        for p in infra:
            try:
                servers.wait_port(p.port, p.popen, p.name)
            except servers.ServerError as e:
                hint = servers.REDIS_TLS_HINT if self.tls is not None and p.name == "redis" else ""
                raise StackError(f"{e}{hint}; log {p.log}:\n{_tail(p.log.read_text(errors='replace'))}") from None

    def _spawn_gateway(self) -> None:
        env = self.env() | {
            "SF_GATEWAY_PORT": str(self.o.gateway_port),
            "SF_GATEWAY_ADMIN_PORT": str(self.o.admin_port),
            "SF_GATEWAY_MODEL": self.o.served_model,
            "SF_GATEWAY_API_KEYS": self.api_key,
            "SF_GATEWAY_ADMIN_KEY": self.admin_key,
            "SF_GATEWAY_MAX_CONTEXT": str(self.o.max_model_len),
        }
        env.setdefault("SF_GATEWAY_TRAINER_METRICS_URL", f"http://127.0.0.1:{self.trainer_metrics_port}/metrics")
        self._spawn("gateway", [sys.executable, "-m", "services.gateway"], env, ready="gateway ready")

    def _metrics(self, name: str, env: dict[str, str], var: str) -> None:
        """Give the process a Prometheus port of its own (loopback), unless `var` is already set."""
        env.setdefault(var, str(servers.free_port()))
        if env[var] != "0":
            self.metrics_urls[name] = f"http://127.0.0.1:{env[var]}/metrics"

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None, ready: str,
               log: Path | None = None, port: int = 0) -> Proc:
        log = log or self.logs / f"{name}.log"
        offset = log.stat().st_size if log.exists() else 0
        cpus = self.pins.get(name, self.control_cpus)
        with open(log, "ab") as out:
            popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                     preexec_fn=_affinity(cpus) if cpus else None)
        proc = Proc(name, popen, log, ready, offset, argv, env, port)
        self.procs.append(proc)
        return proc

    def _wait_ready(self, p: Proc) -> None:
        if not p.ready:
            return
        deadline = time.monotonic() + self.o.ready_timeout
        while time.monotonic() < deadline:
            text = p.log.read_bytes()[p.offset:].decode(errors="replace")
            if p.ready in text:
                return
            if p.popen.poll() is not None:
                raise StackError(f"{p.name} exited with code {p.popen.returncode}:\n{_tail(text)}")
            time.sleep(0.2)
        raise StackError(f"{p.name} not ready after {self.o.ready_timeout:.0f}s; log {p.log}:\n"
                         f"{_tail(p.log.read_text(errors='replace'))}")


def _tail(text: str, n: int = 25) -> str:
    return "\n".join(text.splitlines()[-n:])


def log_tail(path: Path, n: int = 15) -> str:
    """The last `n` lines of a log file ("" if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
            return _tail(f.read().decode(errors="replace"), n)
    except OSError:
        return ""


def _affinity(cpus: tuple[int, ...]):
    """A preexec_fn that runs the child on `cpus` (it and whatever it starts)."""
    return lambda: os.sched_setaffinity(0, cpus)


def _signal_group(p: Proc, sig: int) -> None:
    try:
        os.killpg(p.popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
