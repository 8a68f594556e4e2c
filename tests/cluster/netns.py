"""A cluster of N shared-nothing hosts on one machine, for tests and benchmarks.

    with Cluster(3, rate_mbit=1000) as c:           # needs root and iproute2
        nats = c.hosts[0].popen(["nats-server", "-a", c.hosts[0].addr, "-p", "4222"])
        c.hosts[1].run(["python", "-c", "..."], env={"SF_NATS_URL": f"nats://{c.hosts[0].addr}:4222"})

Each host is
- a **network namespace** `<prefix>-h<i>` with its own loopback and one veth on a
  bridge `<prefix>br`, at `10.<a>.<b>.<i+1>/24`. The bridge holds `.254`, so the
  process that drives the cluster reaches every host by address; hosts reach each
  other only over the bridge (their 127.0.0.1 is their own);
- a **data root** `<base>/host-<i>` and a **mount namespace** per command: every other
  host's root is covered by an empty read-only tmpfs, and /tmp and /dev/shm are the
  host's own, so no host can read or write another's files. Code (the repository and
  the venv) is common, like an image installed on every host; data is not;
- an optional **link shape**: `tc netem delay/rate` on the host's interface, or `tbf`
  for bandwidth alone where the kernel lacks netem (this machine's does: see `shape`).

Clean-up never depends on the test passing: `Cluster` is a context manager whose exit
kills every process in every namespace and deletes namespaces, veths and bridge, and
its creation first sweeps what a killed run left behind. Every object's name starts
with `PREFIX` and a per-cluster id; the owner's pid is kept in `<base>/owner`, and a
cluster whose owner is gone is stale.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "sfc"  # every namespace, link and base dir the harness makes starts with it
BASE_PARENT = Path("/var/tmp")  # not /tmp: each host gets a /tmp of its own, mounted over the real one
IP = "ip"


class ClusterUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no iproute2, no permission)."""


class ShapingUnavailable(RuntimeError):
    """The link shape asked for cannot be set with this kernel's queueing disciplines."""


@functools.cache
def unavailable_reason() -> str:
    """"" where the harness can run, else why not (the suite's skip reason); probed once per process."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    for tool in (IP, "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (iproute2 / util-linux)"
    probe = f"{PREFIX}probe{os.getpid()}"
    r = subprocess.run([IP, "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    subprocess.run([IP, "netns", "del", probe], capture_output=True)
    return ""


def _ip(*args: str, ns: str = "", check: bool = True) -> subprocess.CompletedProcess:
    argv = [IP, *(["netns", "exec", ns, IP] if ns else []), *args]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise ClusterUnavailable(f"{' '.join(argv)}: {r.stderr.strip()}")
    return r


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Host:
    index: int
    ns: str
    addr: str
    root: Path
    iface: str  # inside the namespace
    others: list[Path] = field(default_factory=list)  # the other hosts' roots, hidden from this one
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"host-{self.index}"

    def argv(self, cmd: list[str]) -> list[str]:
        """`cmd` as run on this host: in its network namespace and a mount namespace of its own."""
        hide = "".join(f"mount -t tmpfs -o ro,size=4k,mode=0555 sfc-hidden {shlex.quote(str(p))}; "
                       for p in self.others)
        tmp = shlex.quote(str(self.root / "tmp"))
        script = (f"set -e; mount --make-rprivate /; {hide}"
                  f"mount --bind {tmp} /tmp; mount -t tmpfs -o size=8g sfc-shm /dev/shm; "
                  f'cd {shlex.quote(str(self.root))}; exec "$@"')
        return [IP, "netns", "exec", self.ns, "unshare", "--mount", "--", "sh", "-c", script, "sh", *cmd]

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return dict(os.environ) | {"SF_HOST_ID": self.name, "SF_DATA_DIR": str(self.root / "var")} | (extra or {})

    def popen(self, cmd: list[str], env: dict[str, str] | None = None, log: str | None = None,
              **kw) -> subprocess.Popen:
        """Start `cmd` on this host (its own process group); its output goes to `root/logs/<log>` if named."""
        out = None
        if log:
            (self.root / "logs").mkdir(exist_ok=True)
            out = open(self.root / "logs" / log, "ab")  # noqa: SIM115  handed to the child, closed below
        try:
            p = subprocess.Popen(self.argv(cmd), env=self.env(env), stdout=out or kw.pop("stdout", None),
                                 stderr=subprocess.STDOUT if out else kw.pop("stderr", None),
                                 start_new_session=True, **kw)
        finally:
            if out:
                out.close()
        self.procs.append(p)
        return p

    def run(self, cmd: list[str], env: dict[str, str] | None = None, timeout: float = 60,
            check: bool = False) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(cmd), env=self.env(env), capture_output=True, text=True,
                              timeout=timeout, check=check)

    def log(self, name: str) -> str:
        p = self.root / "logs" / name
        return p.read_text(errors="replace") if p.exists() else ""


class Cluster:
    def __init__(self, n: int, rate_mbit: float = 0.0, delay_ms: float = 0.0, prefix: str = PREFIX,
                 base_parent: Path = BASE_PARENT):
        if n < 1:
            raise ValueError("a cluster needs at least one host")
        self.n, self.rate_mbit, self.delay_ms = n, rate_mbit, delay_ms
        self.id = uuid.uuid4().hex[:5]
        self.tag = f"{prefix}{self.id}"  # 8 chars; link names stay within IFNAMSIZ (15)
        self.prefix = prefix
        self.base = base_parent / f"{prefix}-{self.id}"
        self.bridge = f"{self.tag}br"
        self.hosts: list[Host] = []
        self.shaping = ""  # what `shape` set: "netem ...", "tbf ..." or ""
        self._made: list[tuple[str, str]] = []  # ("ns"|"link", name), in creation order

    # -- life cycle ------------------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        try:
            self.create()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def create(self) -> None:
        sweep_stale(self.prefix, self.base.parent)
        self.base.mkdir(parents=True)
        (self.base / "owner").write_text(str(os.getpid()))
        net = _free_subnet()
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        _ip("addr", "add", f"{net[254]}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        self.gateway = str(net[254])
        roots = [self.base / f"host-{i}" for i in range(self.n)]
        for i, root in enumerate(roots):
            ns, outer, inner = f"{self.tag}-h{i}", f"{self.tag}v{i}", f"{self.tag}p{i}"
            _ip("netns", "add", ns)
            self._made.append(("ns", ns))
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            self._made.append(("link", outer))
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "master", self.bridge, "up")
            _ip("addr", "add", f"{net[i + 1]}/24", "dev", inner, ns=ns)
            _ip("link", "set", inner, "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
            for sub in ("tmp", "logs", "var"):
                (root / sub).mkdir(parents=True)
            self.hosts.append(Host(i, ns, str(net[i + 1]), root, inner, [r for r in roots if r != root]))
        if self.rate_mbit or self.delay_ms:
            self.shape(self.rate_mbit, self.delay_ms)

    def destroy(self) -> None:
        """Kill every process on every host, then delete what `create` made (each step best effort)."""
        _kill_groups([p for h in self.hosts for p in h.procs])
        _kill_namespaces([name for kind, name in self._made if kind == "ns"])
        for kind, name in reversed(self._made):
            _ip("netns" if kind == "ns" else "link", "del", name, check=False)
        self._made.clear()
        shutil.rmtree(self.base, ignore_errors=True)

    # -- the network -----------------------------------------------------------------------------

    def shape(self, rate_mbit: float, delay_ms: float = 0.0) -> str:
        """Every host's outgoing link: `rate_mbit` (0 = unlimited) and `delay_ms` one way.

        netem does both. This machine's kernel has no sch_netem ("Specified qdisc kind is
        unknown"); there bandwidth alone is set with tbf, and a delay raises
        ShapingUnavailable rather than being silently dropped."""
        applied = ""
        for h in self.hosts:
            applied = _shape(h.ns, h.iface, rate_mbit, delay_ms)
        self.shaping = applied
        return applied

    def cut(self, host: int) -> None:
        """A network partition: `host` loses its link to every other host (its bridge port goes
        down, so its packets go nowhere and none reach it). Its processes run on, and its TCP
        connections stay open but stall, as across a failed switch; `heal` brings the link back."""
        _ip("link", "set", f"{self.tag}v{host}", "down")

    def heal(self, host: int, timeout: float = 10.0) -> None:
        """The link back up; returns once it has carrier again. Address resolutions that failed
        during the cut are forgotten on every host, so the first packet after it is not held back."""
        _ip("link", "set", f"{self.tag}v{host}", "up")
        h = self.hosts[host]
        deadline = time.monotonic() + timeout
        while "LOWER_UP" not in _ip("-o", "link", "show", h.iface, ns=h.ns).stdout:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{h.name}: no carrier {timeout:g}s after the heal")
            time.sleep(0.05)
        for other in self.hosts:
            _ip("neigh", "flush", "dev", other.iface, ns=other.ns, check=False)

    @contextlib.contextmanager
    def partitioned(self, host: int):
        """`with c.partitioned(2): ...`: the link is back when the block ends, however it ends."""
        self.cut(host)
        try:
            yield
        finally:
            self.heal(host)

    def url(self, host: int, port: int, scheme: str) -> str:
        return f"{scheme}://{self.hosts[host].addr}:{port}"


def _shape(ns: str, iface: str, rate_mbit: float, delay_ms: float) -> str:
    base = ["qdisc", "replace", "dev", iface, "root"]
    if not rate_mbit and not delay_ms:
        _ip("qdisc", "del", "dev", iface, "root", ns=ns, check=False)
        return ""
    netem = ["netem", *(["delay", f"{delay_ms}ms"] if delay_ms else []),
             *(["rate", f"{rate_mbit}mbit"] if rate_mbit else [])]
    r = _tc(ns, *base, *netem)
    if r.returncode == 0:
        return " ".join(netem)
    if delay_ms:
        raise ShapingUnavailable(f"cannot set a {delay_ms} ms delay: {r.stderr.strip()} (tc netem)")
    # tbf: the bucket must hold at least one timer tick of traffic; 1 ms of line rate, >= 64 KiB
    burst = max(64 * 1024, int(rate_mbit * 1e6 / 8 / 1000))
    tbf = ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "100ms"]
    r = _tc(ns, *base, *tbf)
    if r.returncode != 0:
        raise ShapingUnavailable(f"tc {' '.join(tbf)}: {r.stderr.strip()}")
    return " ".join(tbf)


def _tc(ns: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([IP, "netns", "exec", ns, "tc", *args], capture_output=True, text=True, timeout=30)


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.200.0.0/13 that no interface here uses (a concurrent cluster has its own)."""
    used = subprocess.run([IP, "-o", "-4", "addr"], capture_output=True, text=True).stdout
    taken = {ipaddress.ip_interface(a).network for a in re.findall(r"inet (\S+)", used)}
    seed = int(uuid.uuid4().hex[:6], 16)
    for k in range(2048):
        n = (seed + k) % 2048
        net = ipaddress.ip_network(f"10.{200 + n // 256}.{n % 256}.0/24")
        if not any(net.overlaps(t) for t in taken):
            return net
    raise ClusterUnavailable("no free /24 in 10.200.0.0/13")


def _signal(pids: list[int], sig: signal.Signals, group: bool = False) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            (os.killpg if group else os.kill)(pid, sig)


def _wait_gone(alive, pids: list[int], timeout: float) -> list[int]:
    """Poll until no pid is `alive` or `timeout` passes; returns those still alive."""
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _kill_groups(procs: list[subprocess.Popen], term_wait: float = 5.0, kill_wait: float = 5.0) -> None:
    """SIGTERM every process group at once, one bounded wait for all, then SIGKILL the groups left."""
    running = {p.pid: p for p in procs if p.poll() is None}

    def alive(pid: int) -> bool:
        return running[pid].poll() is None

    for sig, wait in ((signal.SIGTERM, term_wait), (signal.SIGKILL, kill_wait)):
        _signal(list(running), sig, group=True)
        if not (left := _wait_gone(alive, list(running), wait)):
            return
        running = {pid: running[pid] for pid in left}


def _kill_namespaces(names: list[str], term_wait: float = 3.0, kill_wait: float = 2.0) -> None:
    """SIGTERM, then SIGKILL, whatever still runs in any of `names` (a child that left our process
    group too): every namespace at once, one bounded wait each round."""
    for sig, wait in ((signal.SIGTERM, term_wait), (signal.SIGKILL, kill_wait)):
        pids = [int(x) for ns in names for x in _ip("netns", "pids", ns, check=False).stdout.split()]
        if not pids:
            return
        _signal(pids, sig)
        _wait_gone(_pid_alive, pids, wait)


def _kill_namespace(ns: str) -> None:
    _kill_namespaces([ns])


def sweep_stale(prefix: str = PREFIX, base_parent: Path = BASE_PARENT) -> list[str]:
    """Remove what a cluster whose owner process is gone left behind; returns what it removed."""
    removed: list[str] = []
    pattern = re.compile(rf"^{re.escape(prefix)}([0-9a-f]{{5}})")

    def stale(cid: str) -> bool:
        owner = base_parent / f"{prefix}-{cid}" / "owner"
        try:
            return not _pid_alive(int(owner.read_text()))
        except (OSError, ValueError):
            return True  # no owner file: its base is gone, so is its owner

    for ns in _ip("netns", "list", check=False).stdout.split("\n"):
        name = ns.split(" ")[0]
        if (m := pattern.match(name)) and stale(m.group(1)):
            _kill_namespace(name)
            _ip("netns", "del", name, check=False)
            removed.append(name)
    for line in _ip("-o", "link", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if (m := pattern.match(name)) and stale(m.group(1)):
            _ip("link", "del", name, check=False)
            removed.append(name)
    for d in base_parent.glob(f"{prefix}-*"):
        cid = d.name[len(prefix) + 1:]
        if re.fullmatch(r"[0-9a-f]{5}", cid) and stale(cid):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(str(d))
    return removed
