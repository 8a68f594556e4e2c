"""deploy/compose files against the Compose Specification schema (check-jsonschema's vendored
copy, `vendor.compose-spec`), and the compose runner's variable interpolation."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shared import redissentinel
from shared.config import connections, jetstream_replicas
from tests.integration.compose_local import ComposeError, interpolate

COMPOSE = Path(__file__).resolve().parents[2] / "deploy" / "compose"
FILES = [COMPOSE / "docker-compose.yml", COMPOSE / "compose.gpu.yaml", COMPOSE / "compose.ha.yaml",
         COMPOSE / "compose.tls.yaml", COMPOSE / "compose.ha-tls.yaml"]
TLS_ENV = ("SF_NATS_TLS_CA", "SF_NATS_TLS_CERT", "SF_NATS_TLS_KEY", "SF_REDIS_TLS_CA", "SF_REDIS_TLS_CERT",
           "SF_REDIS_TLS_KEY")
CERTS = "./certs:/certs:ro"


def test_files_match_the_compose_specification():
    tool = Path(sys.executable).parent / "check-jsonschema"
    done = subprocess.run([str(tool), "--builtin-schema", "vendor.compose-spec", *map(str, FILES)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_gpu_override_reserves_devices_for_rollout_and_trainer():
    gpu = yaml.safe_load(FILES[1].read_text())["services"]
    for name in ("rollout", "trainer"):
        (dev,) = gpu[name]["deploy"]["resources"]["reservations"]["devices"]
        assert dev["capabilities"] == ["gpu"] and dev["driver"] == "nvidia"
    base = yaml.safe_load(FILES[0].read_text())["services"]
    assert set(gpu) <= set(base)  # an override names only services the base file has


def test_ha_override_gives_every_service_the_cluster_and_sentinel_urls():
    ha = yaml.safe_load(FILES[2].read_text())["services"]
    base = yaml.safe_load(FILES[0].read_text())["services"]
    assert {"scheduler", "host-trainer"} <= set(base)
    for name, svc in base.items():
        if "SF_NATS_URL" in (svc.get("environment") or {}):
            env = ha[name]["environment"]
            assert env["SF_NATS_URL"].count("nats://") == 3 and env["SF_JETSTREAM_REPLICAS"] == "3", name
            assert env["SF_REDIS_URL"].startswith("redis+sentinel://"), name
    assert {"nats-2", "nats-3", "redis-replica", "sentinel-1", "sentinel-2", "sentinel-3"} <= set(ha)


def test_tls_override_gives_every_service_the_tls_settings_and_the_servers_their_certificates():
    tls = yaml.safe_load(FILES[3].read_text())["services"]
    base = yaml.safe_load(FILES[0].read_text())["services"]
    for name, svc in base.items():
        env = svc.get("environment") or {}
        if "SF_NATS_URL" in env:
            over = tls[name]["environment"]
            # the override repeats what the base sets, so the file reads whole on its own
            assert set(env) <= set(over), (name, set(env) - set(over))
            for k in TLS_ENV:
                assert over[k].startswith("/certs/"), (name, k)
            assert CERTS in tls[name]["volumes"], name
            assert set(svc.get("volumes") or []) <= set(tls[name]["volumes"]), name
    assert "--tlsverify" in tls["nats"]["command"]
    redis = tls["redis"]["command"]
    assert redis[redis.index("--port") + 1] == "0" and redis[redis.index("--tls-auth-clients") + 1] == "yes"


def _block(text: str, head: str) -> str:
    """The body of the first `head {...}` in a nats-server config (braces matched); "" if none."""
    at = text.find(head + " {")
    if at < 0:
        return ""
    depth, start = 0, text.index("{", at)
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1:i]
    return ""


def _arg(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv and argv.index(flag) + 1 < len(argv) else None


def _nats_problems(name: str, svc: dict, configs: dict, members: set[str]) -> list[str]:
    argv = svc.get("command") or []
    mounted = {c["target"]: c["source"] for c in svc.get("configs") or []}
    conf = (configs.get(mounted.get(_arg(argv, "-c") or ""), {}) or {}).get("content", "")
    cluster = _block(conf, "cluster")
    client_tls = _block(conf.replace("cluster {" + cluster + "}", ""), "tls")
    route_tls = _block(cluster, "tls")
    out = [] if "verify: true" in client_tls and "/certs/server.crt" in client_tls else [f"{name}: client tls"]
    out += [] if "verify: true" in route_tls and "/certs/route.crt" in route_tls else [f"{name}: route tls"]
    out += [] if all(f"nats://{m}:6222" in cluster for m in members) else [f"{name}: routes"]
    out += [] if "no_advertise: true" in cluster else [f"{name}: advertises gossiped addresses"]
    return out + ([] if "-js" in argv and _arg(argv, "--pass") and _arg(argv, "-n") else [f"{name}: argv"])


def _redis_problems(name: str, svc: dict) -> list[str]:
    argv = svc.get("command") or []
    want = {"--port": "0", "--tls-port": "6379", "--tls-auth-clients": "yes", "--tls-replication": "yes",
            "--tls-client-cert-file": "/certs/client.crt", "--replica-announce-ip": name}
    return [f"{name}: {k}" for k, v in want.items() if _arg(argv, k) != v]


SENTINEL_TLS = ("port 0\\n", "tls-port 26379", "tls-auth-clients yes", "tls-replication yes", "tls-cert-file /certs/",
                "tls-client-cert-file /certs/", "sentinel announce-hostnames yes")


def ha_tls_problems(base: dict, ha: dict, hatls: dict, tls: dict) -> list[str]:
    """What compose.ha-tls.yaml lacks for TLS on every connection of the HA layout ([] if nothing)."""
    svcs = hatls.get("services") or {}
    both = {n: {**base["services"].get(n, {}), **ha["services"].get(n, {})} for n in {*base["services"], *ha["services"]}}
    out = []
    nats = {n for n, s in both.items() if str(s.get("image", "")).startswith("nats:")}
    for name in sorted(nats):
        out += _nats_problems(name, svcs.get(name) or {}, hatls.get("configs") or {}, nats)
    for name in ("redis", "redis-replica"):
        out += _redis_problems(name, svcs.get(name) or {})
    out += [] if _arg((svcs.get("redis-replica") or {}).get("command") or [], "--replicaof") == "redis" else ["replicaof"]
    for name in sorted(n for n in both if n.startswith("sentinel")):
        conf = " ".join((svcs.get(name) or {}).get("command") or [])
        out += [f"{name}: {want}" for want in SENTINEL_TLS if want not in conf]
    for name in sorted(nats | {"redis", "redis-replica"} | {n for n in both if n.startswith("sentinel")}):
        out += [] if CERTS in ((svcs.get(name) or {}).get("volumes") or []) else [f"{name}: certs mount"]
    for name, svc in base["services"].items():
        if "SF_NATS_URL" not in (svc.get("environment") or {}):
            continue
        over = svcs.get(name) or {}
        env, vols = over.get("environment") or {}, over.get("volumes") or []
        out += [f"{name}: {k}" for k in TLS_ENV if not str(env.get(k, "")).startswith("/certs/")]
        seeds = str(env.get("SF_NATS_URL", "")).split(",")
        out += [] if len(seeds) == len(nats) and all(u.startswith("tls://") for u in seeds) else [f"{name}: nats url"]
        out += [] if str(env.get("SF_REDIS_URL", "")).startswith("redis+sentinel://") else [f"{name}: redis url"]
        out += [] if CERTS in vols and set(svc.get("volumes") or []) <= set(vols) else [f"{name}: volumes"]
    for name, svc in tls["services"].items():  # compose.tls.yaml before it changes nothing
        over = svcs.get(name) or {}
        out += [f"{name}: {k} of compose.tls.yaml" for k in set(svc) - set(over)]
        out += [f"{name}: {k} of compose.tls.yaml" for k in set(svc.get("environment") or {}) - set(over.get("environment") or {})]
    return out


def _load_all() -> tuple[dict, dict, dict, dict]:
    base, _, ha, tls, hatls = (yaml.safe_load(f.read_text()) for f in FILES)
    return base, ha, hatls, tls


def test_ha_tls_override_puts_every_connection_of_the_ha_layout_on_tls():
    base, ha, hatls, tls = _load_all()
    assert ha_tls_problems(base, ha, hatls, tls) == []
    assert {"nats", "nats-2", "nats-3", "sentinel-1", "sentinel-3"} <= set(hatls["services"])


def test_ha_tls_service_settings_load_as_the_services_take_them(tmp_path):
    base, _, hatls, _ = _load_all()
    for f in ("ca.crt", "client.crt", "client.key"):
        (tmp_path / f).write_text("")
    secrets = {"SF_NATS_PASSWORD": "n", "SF_REDIS_PASSWORD": "r", "SF_API_KEY": "a", "SF_ADMIN_KEY": "b"}
    sentinels = sorted(n for n in hatls["services"] if n.startswith("sentinel"))
    for name, svc in base["services"].items():
        if "SF_NATS_URL" not in (svc.get("environment") or {}):
            continue
        env = {k: interpolate(str(v), secrets).replace("/certs/", f"{tmp_path}/")
               for k, v in hatls["services"][name]["environment"].items()}
        conn = connections(env)
        assert conn.nats_tls is not None and conn.nats_tls.cert and conn.redis_tls is not None, name
        assert [u.split("://")[0] for u in conn.nats_servers] == ["tls"] * 3 and jetstream_replicas(env) == 3, name
        target = redissentinel.parse(conn.redis_url)
        assert [h for h, _ in target.sentinels] == sentinels and target.service == "sf" and target.password == "r", name
    assert "sentinel monitor sf redis 6379 2" in hatls["services"]["sentinel-1"]["command"][2]


def _drop_arg(argv: list[str], flag: str) -> None:
    del argv[argv.index(flag):argv.index(flag) + 2]


def _conf(f: dict, old: str, new: str) -> None:
    conf = f["configs"]["nats-cluster-tls"]
    conf["content"] = conf["content"].replace(old, new, 1)


def _sentinel(f: dict, name: str, old: str, new: str) -> None:
    f["services"][name]["command"] = [c.replace(old, new) for c in f["services"][name]["command"]]


# each removal, and the problem the check must name for it
MUTATIONS = {
    "nats: client tls": lambda f: _conf(f, "tls {", "x {"),
    "nats-3: route tls": lambda f: _conf(f, "/certs/route.crt", "/certs/server.crt"),
    "nats-2: advertises gossiped addresses": lambda f: _conf(f, "no_advertise: true", ""),
    "nats-3: routes": lambda f: f["services"]["nats-3"].pop("configs"),
    "redis-replica: --tls-replication": lambda f: _drop_arg(f["services"]["redis-replica"]["command"], "--tls-replication"),
    "redis: --port": lambda f: _drop_arg(f["services"]["redis"]["command"], "--port"),
    "redis: --replica-announce-ip": lambda f: _drop_arg(f["services"]["redis"]["command"], "--replica-announce-ip"),
    "sentinel-2: tls-port 26379": lambda f: _sentinel(f, "sentinel-2", "tls-port", "port"),
    "sentinel-1: tls-replication yes": lambda f: _sentinel(f, "sentinel-1", "tls-replication yes\\n", ""),
    "sentinel-3: certs mount": lambda f: f["services"]["sentinel-3"].update(volumes=[]),
    "nats-2: certs mount": lambda f: f["services"]["nats-2"]["volumes"].remove(CERTS),
    "gateway: SF_REDIS_TLS_KEY": lambda f: f["services"]["gateway"]["environment"].pop("SF_REDIS_TLS_KEY"),
    "trainer: volumes": lambda f: f["services"]["trainer"]["volumes"].remove(CERTS),
    "rollout: nats url": lambda f: f["services"]["rollout"]["environment"].update(SF_NATS_URL="nats://nats:4222"),
    "scheduler: redis url": lambda f: f["services"]["scheduler"]["environment"].update(
        SF_REDIS_URL="redis://:p@redis:6379/0"),
}


@pytest.mark.parametrize("problem", MUTATIONS)
def test_ha_tls_check_names_each_part_removed(problem):
    base, ha, hatls, tls = _load_all()
    hatls = copy.deepcopy(hatls)
    hatls["services"] = {k: copy.deepcopy(v) for k, v in hatls["services"].items()}  # the sentinels share an anchor
    MUTATIONS[problem](hatls)
    assert problem in ha_tls_problems(base, ha, hatls, tls)


def test_interpolation_follows_compose():
    v = {"A": "1", "E": ""}
    assert interpolate("${A}-${B:-x}-${E:-y}-${E-z}", v) == "1-x-y-"
    with pytest.raises(ComposeError, match="B is missing: set B"):
        interpolate("${B:?set B}", v)
    with pytest.raises(ComposeError):
        interpolate("${E:?empty}", v)
