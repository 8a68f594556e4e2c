"""deploy/k8s: `kubectl kustomize` renders the manifests (no cluster needed), and every object is
checked against the Kubernetes API: the `kubernetes` Python client's models take each one (a
missing required field is an error) and give back exactly what was written (an unknown or
misspelt field would be dropped, so it shows as a difference). Then what issue 30 asks of them."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
kubernetes = pytest.importorskip("kubernetes")  # requirements/common.txt

@functools.cache
def _kustomize(root: Path) -> str:
    """`kubectl kustomize root`'s output, run once per root for the module (each test parses its own copy)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    done = subprocess.run([kubectl, "kustomize", str(root)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def rendered(root: Path = K8S) -> list[dict]:
    return [o for o in yaml.safe_load_all(_kustomize(root)) if o]


@pytest.fixture(scope="module")
def tls_overlay(tmp_path_factory) -> Path:
    """An overlay with the TLS component, as an operator's enables it (kustomize takes relative paths only)."""
    tmp = tmp_path_factory.mktemp("tls-overlay")
    rel = os.path.relpath(K8S, tmp)
    (tmp / "kustomization.yaml").write_text(f"resources: [{rel}]\ncomponents: [{rel}/tls]\n")
    return tmp


def model_name(obj: dict) -> str:
    """apps/v1 Deployment -> V1Deployment, autoscaling/v2 HorizontalPodAutoscaler -> V2HorizontalPodAutoscaler."""
    version = obj["apiVersion"].rpartition("/")[2]
    return f"{version.capitalize()}{obj['kind']}"


def _clean(x):
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def _stringly(x):  # the models give quantities and int-or-string values back as written
    if isinstance(x, dict):
        return {k: _stringly(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_stringly(v) for v in x]
    return str(x)


@pytest.mark.parametrize("tls", [False, True], ids=["base", "tls"])
def test_every_object_matches_the_kubernetes_api(tls, tls_overlay):
    client = kubernetes.client.ApiClient()
    objects = rendered(tls_overlay) if tls else rendered()
    assert len(objects) >= 15
    for obj in objects:
        name = model_name(obj)
        assert hasattr(kubernetes.client, name), f"{obj['apiVersion']} {obj['kind']}: no such API object"
        model = client._ApiClient__deserialize(obj, name)  # raises on a missing required field
        back = _clean(client.sanitize_for_serialization(model))
        assert _stringly(back) == _stringly(obj), f"{obj['kind']}/{obj['metadata']['name']}: a field the API does not have"


def test_what_the_cluster_needs():
    objects = {(o["kind"], o["metadata"]["name"]): o for o in rendered()}
    assert objects[("Deployment", "scheduler")]["spec"]["replicas"] >= 2  # a standby
    for name in ("gateway", "trajectory"):
        assert objects[("HorizontalPodAutoscaler", name)]["spec"]["metrics"][0]["pods"]["metric"]["name"] == \
            "sf_turns_per_second"
    assert ("DaemonSet", "host-agent") in objects
    job = objects[("Job", "trainer")]["spec"]
    assert job["completionMode"] == "Indexed" and job["completions"] == job["parallelism"]
    config = objects[("ConfigMap", "seamlessflow")]["data"]
    assert config["SF_JETSTREAM_REPLICAS"] == "3" and config["SF_TRAJECTORY_REDIS_WAIT_REPLICAS"] == "1"
    # NATS and Redis come from their official charts, not from here
    assert not any(re.search(r"nats|redis", n) for _, n in objects)
    assert all(o["metadata"].get("namespace") == "seamlessflow" for (k, _), o in objects.items()
               if k not in ("Namespace", "ClusterRole", "ClusterRoleBinding"))


def test_the_tls_component_puts_every_service_on_tls(tls_overlay):
    base = {(o["kind"], o["metadata"]["name"]): o for o in rendered()}
    objects = {(o["kind"], o["metadata"]["name"]): o for o in rendered(tls_overlay)}
    assert objects.keys() == base.keys()  # nothing added or lost: the certificates are the operator's Secret
    config = objects[("ConfigMap", "seamlessflow")]["data"]
    for server in ("NATS", "REDIS"):
        assert config[f"SF_{server}_TLS_CA"] == "/certs/ca.crt"
        assert (config[f"SF_{server}_TLS_CERT"], config[f"SF_{server}_TLS_KEY"]) == ("/certs/client.crt",
                                                                                    "/certs/client.key")
    workloads = [o for (kind, _), o in objects.items() if kind in ("Deployment", "DaemonSet", "Job", "StatefulSet")]
    assert len(workloads) == 5
    for o in workloads:
        pod = o["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == "seamlessflow-tls", o["metadata"]["name"]
        # every container that runs a service reads the settings and has the files where they point
        for c in pod["containers"]:
            assert {"configMapRef": {"name": "seamlessflow"}} in c["envFrom"], (o["metadata"]["name"], c["name"])
            assert {"name": "tls", "mountPath": "/certs", "readOnly": True} in c["volumeMounts"], c["name"]
        # and the base's own volumes are all still there
        base_pod = base[(o["kind"], o["metadata"]["name"])]["spec"]["template"]["spec"]
        assert {v["name"] for v in base_pod.get("volumes", [])} <= volumes.keys()
