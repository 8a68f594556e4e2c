"""A trainer across nodes on real DeepSpeed (gloo, CPU): each rank's host, one host's offload, a real
step, node-local checkpoint dirs and the resume rank 0 decides (tests/cluster/multinode_check.py).

1. two processes on this machine, each "node" with its own checkpoint dir (no namespaces needed);
2. `torchrun --nnodes 2` across two namespace hosts, rendezvous and gloo over the bridge, each host's
   checkpoint dir on its own root at the same relative path (skipped where namespaces can't be made).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.deepspeed, pytest.mark.filterwarnings("ignore:.*is deprecated.*:FutureWarning")]

ROOT = Path(__file__).resolve().parents[2]
CHECK = ["-m", "tests.cluster.multinode_check"]
STEPS = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_reports(reports: list[dict], hosts: list[str], dirs: list[Path]) -> None:
    r0, r1 = reports
    assert r0["rank_hosts"] == r1["rank_hosts"] == hosts  # every rank knows every rank's host
    assert r0["hosts"] == hosts and [r["host"] for r in reports] == hosts
    # the lend of the last host offloaded its rank only; the reclaim restored it
    assert r0["offloaded_after_offload"] == [False, True] and r0["offloaded_after_reload"] == [False, False]
    # a real step: both ranks computed the same global loss, and hold the same parameters
    assert r0["losses"] == pytest.approx(r1["losses"], abs=1e-6) and all(x == x for x in r0["losses"])
    assert r0["all_trained"][0] == r0["all_trained"][1]
    # node-local checkpoints: `latest` only in rank 0's dir, the model states in each node's own dir
    tag = r0["tag"]
    assert "latest" in r0["own_dir"] and "latest" not in r1["own_dir"]
    for r, d in zip(reports, dirs):
        assert f"{tag}/mp_rank_00_model_states.pt" in r["own_dir"], r["own_dir"]
        assert (d / tag).is_dir()
    # the resume was decided on rank 0 and worked on both nodes: same client state, same parameters
    for r in reports:
        assert r["resumed_client"] == {"step": STEPS}
        assert r["resumed"] == r["trained"] and r["resumed_steps"] == STEPS


def test_resume_with_node_local_checkpoint_dirs(tiny_model, tmp_path):
    """Two gloo ranks, each its own 'node' (LOCAL_RANK 0) with its own checkpoint dir, under nice."""
    port, out = free_port(), tmp_path / "out"
    dirs = [tmp_path / f"node{r}" / "ckpt" for r in range(2)]
    procs = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), SF_HOST_ID=f"node-{r}",
                   SF_TRAINER_CHECKPOINT_DIR=str(dirs[r]), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        procs.append(subprocess.Popen(["nice", "-n", "19", sys.executable, *CHECK, "--model", str(tiny_model),
                                       "--out", str(out), "--steps", str(STEPS)], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            p.kill() if p.poll() is None else None
    assert all(p.returncode == 0 for p in procs), "\n".join(x[-3000:] for x in logs)
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    check_reports(reports, ["node-0", "node-1"], dirs)


@pytest.mark.cluster
def test_torchrun_two_nodes_across_namespaces(cluster, tiny_model):
    """torchrun --nnodes 2 on hosts 1 and 2 (host-0 holds nothing here): the rendezvous and every
    collective go over the bridge; no host sees the other's checkpoint dir."""
    import shutil

    c = cluster(3)
    nodes = c.hosts[1:]
    master, port = nodes[0].addr, 29500
    procs = []
    for i, h in enumerate(nodes):
        model = h.root / "model"
        shutil.copytree(tiny_model, model)  # each host its own copy: no path in common
        env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "SF_TRAINER_CHECKPOINT_DIR": "var/ckpt",
               "GLOO_SOCKET_IFNAME": h.iface, "TP_SOCKET_IFNAME": h.iface}
        cmd = ["nice", "-n", "19", sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--nproc_per_node", "1", "--node_rank", str(i), "--master_addr", master, "--master_port", str(port),
               *CHECK, "--model", str(model), "--out", "out", "--steps", str(STEPS)]
        procs.append(h.popen(cmd, env=env, log="torchrun.log", cwd=ROOT))
    for p in procs:
        p.wait(timeout=400)
    logs = "\n".join(h.log("torchrun.log")[-3000:] for h in nodes)
    assert all(p.returncode == 0 for p in procs), logs
    # each node wrote its rank's report into its own root
    reports = [json.loads((h.root / "out" / f"rank{r}.json").read_text()) for r, h in enumerate(nodes)]
    check_reports(reports, [h.name for h in nodes], [h.root / "var" / "ckpt" for h in nodes])
    assert not (nodes[1].root / "out" / "rank0.json").exists()
