"""Multi-LoRA, one adapter per agent role (services/trainer/lora.py, batching.role_micro_batches), on
real DeepSpeed (CPU, gloo): each role's samples train its own adapter and no other, and a published
version is one PEFT adapter dir per role that peft loads as it is.

The trainer service with roles over real NATS is in test_trainer_service.py's style below: real
trajectories naming their roles in their session metadata, the real trainer process, versions on
disk; both adapters advance, a session naming no known role is dead-lettered.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from tests.integration.test_trainer_lora import _full_named, lora_cfg

pytestmark = [
    pytest.mark.deepspeed,
    pytest.mark.filterwarnings("ignore:.*is deprecated.*:FutureWarning"),
]

ROLES = ("planner", "solver")
ROOT = Path(__file__).resolve().parents[2]


def with_roles(groups, roles):
    """The same groups, member i of each naming roles[i % len(roles)] (a role of its own per agent, one
    reward group shared), as the trajectory manager copies a session's metadata onto its trajectory."""
    return [[msgspec.structs.replace(t, metadata={**t.metadata, "role": roles[i % len(roles)]})
             for i, t in enumerate(g)] for g in groups]


def adapter_tensors(eng) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in _full_named(eng).items():
        for role in ROLES:
            if f".{role}." in name:
                out.setdefault(role, {})[name] = t
    return out


def moved(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("stage", [0, 2])
def test_each_role_trains_its_own_adapter_only(modules, tiny_model, stage, tmp_path):
    engine, batching, dp_check, _, TrainerConfig = modules
    cfg = lora_cfg(TrainerConfig, tiny_model, zero_stage=stage, lr=1e-2, kl_coef=0.0, lora_roles=",".join(ROLES))
    eng = engine.TrainEngine(cfg)
    assert eng.roles == ROLES
    vocab = eng.module.config.vocab_size

    def step(groups, only: str = ""):
        gb = batching.build_global_batch(groups, cfg.algo())
        rows = [r for r in gb.rows if not only or r.role == only]
        mbs = batching.role_micro_batches(rows, cfg.micro_batch_tokens, eng.pad_id, eng.roles)
        # the trainer's batches: each micro-batch holds one role's rows and names that role's adapter
        for mb in mbs:
            assert mb.adapter in ROLES
        assert {mb.adapter for mb in mbs} == ({only} if only else set(ROLES))
        return eng.train_step(mbs)

    before = adapter_tensors(eng)
    assert set(before) == set(ROLES)
    # 1. a step on the planner's samples alone: the planner's adapter moves, the solver's is untouched,
    # bit for bit (its gradient is an exact zero and its param group sits the step out)
    groups = with_roles(dp_check.synthetic_groups(0, vocab=vocab), ROLES)
    step(groups, only="planner")
    after1 = adapter_tensors(eng)
    assert moved(before["planner"], after1["planner"]) > 0
    assert moved(before["solver"], after1["solver"]) == 0.0

    # 2. the solver's own samples move the solver's adapter; the planner's, with no samples in this
    # step, sits it out: Adam's momentum from step 1 does not move it (optim.py)
    step(with_roles(dp_check.synthetic_groups(1, vocab=vocab), ROLES), only="solver")
    after2 = adapter_tensors(eng)
    assert moved(after1["solver"], after2["solver"]) > 0
    assert moved(after1["planner"], after2["planner"]) == 0.0

    # 3. a step on both roles, then publish: one PEFT adapter dir per role, each equal to its adapter
    step(with_roles(dp_check.synthetic_groups(2, vocab=vocab), ROLES))
    out = eng.save_hf(tmp_path / "v3")
    from shared.checkpoint import check_checkpoint, role_adapters

    assert sorted(role_adapters(out)) == list(ROLES)
    check_checkpoint(out)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    gb = batching.build_global_batch(with_roles(dp_check.synthetic_groups(3, vocab=vocab), ROLES), cfg.algo())
    for role in ROLES:
        [mb, *_] = batching.role_micro_batches([r for r in gb.rows if r.role == role], cfg.micro_batch_tokens,
                                              eng.pad_id, eng.roles)
        want = eng.logprobs(mb)
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
                                          str(out / role))
        with torch.no_grad():
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits.float()
        got = torch.log_softmax(logits, -1).gather(-1, mb.targets.unsqueeze(-1)).squeeze(-1)
        real = mb.attention_mask.bool()
        assert float((got - want)[real].abs().max()) < 1e-4, role
    # the two adapters differ (trained on different samples), so the check above tells them apart
    a, b = (json.loads((out / r / "adapter_config.json").read_text()) for r in ROLES)
    assert a["r"] == b["r"] == cfg.lora_rank
    from safetensors.torch import load_file

    ta, tb = (load_file(str(out / r / "adapter_model.safetensors")) for r in ROLES)
    assert ta.keys() == tb.keys() and moved(ta, tb) > 0


def role_state(eng, role: str) -> list[dict[str, torch.Tensor]]:
    """The Adam state of `role`'s param group as DeepSpeed steps it: the client AdamW's state of the
    group's params (ZeRO 1-2: this rank's flat fp32 partition; stage 0: the adapter's parameters)."""
    opt = eng.engine.basic_optimizer
    [group] = [g for g in opt.param_groups if g["role"] == role]
    return [{k: v.detach().clone() for k, v in opt.state[p].items()} for p in group["params"]]


def same_state(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b))


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_role_without_samples_sits_the_step_out(modules, tiny_model, stage):
    """Issue 27: a step with no samples of a role leaves that role's adapter and its Adam state bit for
    bit as they were, after a step that gave it momentum (and with weight decay, which AdamW applies
    whatever the gradient); the next step with its samples moves it again."""
    engine, batching, dp_check, _, TrainerConfig = modules
    cfg = lora_cfg(TrainerConfig, tiny_model, zero_stage=stage, lr=1e-2, kl_coef=0.0, weight_decay=0.1,
                   lora_roles=",".join(ROLES))
    eng = engine.TrainEngine(cfg)
    vocab = eng.module.config.vocab_size
    planner, solver = ROLES

    def step(seed: int, only: str = ""):
        gb = batching.build_global_batch(with_roles(dp_check.synthetic_groups(seed, vocab=vocab), ROLES),
                                         cfg.algo())
        rows = [r for r in gb.rows if not only or r.role == only]
        return eng.train_step(batching.role_micro_batches(rows, cfg.micro_batch_tokens, eng.pad_id, eng.roles))

    # 1. both roles' samples: both adapters move and both get Adam state (momentum)
    w0 = adapter_tensors(eng)
    step(0)
    w1 = adapter_tensors(eng)
    assert moved(w0[planner], w1[planner]) > 0 and moved(w0[solver], w1[solver]) > 0
    s1 = {r: role_state(eng, r) for r in ROLES}
    assert all(s1[r] and all(float(s["step"]) == 1 for s in s1[r]) for r in ROLES)

    # 2. the planner's samples alone: the solver's adapter and its Adam state come out bit-identical
    step(1, only=planner)
    w2, s2 = adapter_tensors(eng), {r: role_state(eng, r) for r in ROLES}
    assert moved(w1[solver], w2[solver]) == 0.0
    assert same_state(s1[solver], s2[solver])  # step count, exp_avg, exp_avg_sq
    assert moved(w1[planner], w2[planner]) > 0
    assert all(float(s["step"]) == 2 for s in s2[planner])

    # 3. both again: the solver resumes from the state it had after step 1 (its step count is now 2)
    step(2)
    w3, s3 = adapter_tensors(eng), role_state(eng, solver)
    assert moved(w2[solver], w3[solver]) > 0
    assert all(float(s["step"]) == 2 for s in s3)


@pytest.mark.parametrize("stage", [0, 2])
def test_a_checkpoint_with_a_role_that_never_trained_resumes(modules, tiny_model, stage, tmp_path):
    """The solver sits out the steps before the checkpoint, so its group has no Adam state at all in it;
    the resumed engine continues exactly as the uninterrupted one."""
    engine, batching, dp_check, _, TrainerConfig = modules
    cfg = lora_cfg(TrainerConfig, tiny_model, zero_stage=stage, lr=1e-2, kl_coef=0.0, weight_decay=0.1,
                   lora_roles=",".join(ROLES))
    eng = engine.TrainEngine(cfg)
    vocab = eng.module.config.vocab_size

    def step(e, seed: int, only: str = ""):
        gb = batching.build_global_batch(with_roles(dp_check.synthetic_groups(seed, vocab=vocab), ROLES),
                                         cfg.algo())
        rows = [r for r in gb.rows if not only or r.role == only]
        e.train_step(batching.role_micro_batches(rows, cfg.micro_batch_tokens, e.pad_id, e.roles))

    step(eng, 0, only="planner")
    assert not any(role_state(eng, "solver"))  # never stepped: no state
    eng.save_checkpoint(tmp_path / "ckpt", {"step": 1})
    step(eng, 1)
    step(eng, 2, only="planner")
    want = adapter_tensors(eng)
    fresh = engine.TrainEngine(cfg)
    assert fresh.load_checkpoint(tmp_path / "ckpt") == {"step": 1}
    step(fresh, 1)
    step(fresh, 2, only="planner")
    got = adapter_tensors(fresh)
    for role in ROLES:
        assert moved(want[role], got[role]) == 0.0, role
    assert same_state(role_state(fresh, "solver"), role_state(eng, "solver"))


def test_two_ranks_agree_on_which_roles_sit_a_step_out(tiny_model, tmp_path):
    """torchrun, 2 gloo ranks (tests/integration/multilora_ranks.py): a role whose samples are on one rank
    only is stepped on both (ZeRO-2: each rank steps its own partition of the role's group); a role
    with samples on no rank sits the step out on both."""
    out = tmp_path / "ranks"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "tests.integration.multilora_ranks", "--model", str(tiny_model), "--out", str(out),
           "--stages", "0,2"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for stage in ("zero0", "zero2"):
        ranks = [rep[stage] for rep in reports]
        assert ranks[0]["digest"] == ranks[1]["digest"], stage  # the ranks end with the same weights
        both, one, planner_only = ranks[0]["steps"]
        assert ranks[0]["steps"][1]["local_roles"] == ["planner", "solver"]
        assert ranks[1]["steps"][1]["local_roles"] == ["planner"]
        # 2. the solver's samples on rank 0 only: every solver tensor moves, rank 1's partition too
        assert one["solver"]["least"] > 0, stage
        # 3. no solver samples anywhere: the solver's adapter is bit-identical, the planner's moves
        assert planner_only["solver"]["most"] == 0.0, stage
        assert planner_only["planner"]["most"] > 0, stage
        assert both["solver"]["least"] > 0 and both["planner"]["most"] > 0


def test_multilora_checkpoint_exports_each_role(modules, tiny_model, tmp_path):
    from shared import adapters

    engine, batching, dp_check, _, TrainerConfig = modules
    cfg = lora_cfg(TrainerConfig, tiny_model, zero_stage=2, kl_coef=0.0, lora_roles=",".join(ROLES))
    eng = engine.TrainEngine(cfg)
    gb = batching.build_global_batch(with_roles(dp_check.synthetic_groups(0, vocab=eng.module.config.vocab_size),
                                                ROLES), cfg.algo())
    eng.train_step(batching.role_micro_batches(gb.rows, cfg.micro_batch_tokens, eng.pad_id, eng.roles))
    eng.save_checkpoint(tmp_path / "ckpt", {"step": 1})
    published = eng.save_hf(tmp_path / "v1")
    from safetensors.torch import load_file

    for role in ROLES:
        out = adapters.adapter_from_checkpoint(tmp_path / "ckpt", tmp_path / f"export-{role}", role=role)
        want = load_file(str(published / role / "adapter_model.safetensors"))
        got = load_file(str(out / "adapter_model.safetensors"))
        assert got.keys() == want.keys()
        assert moved(got, want) == 0.0
    with pytest.raises(adapters.CheckpointError, match="name one of its roles"):
        adapters.adapter_from_checkpoint(tmp_path / "ckpt", tmp_path / "export-none")
    # `seamlessflow export --adapter VERSION --role R`: the role's adapter dir as it is
    from seamlessflow.ops.export_weights import export_weights

    export_weights(published, tmp_path / "cli-solver", merge=False, role="solver")
    assert moved(load_file(str(tmp_path / "cli-solver" / "adapter_model.safetensors")),
                 load_file(str(published / "solver" / "adapter_model.safetensors"))) == 0.0
    with pytest.raises(SystemExit, match="--role"):
        export_weights(published, tmp_path / "cli-none", merge=False)


def test_roles_need_lora_and_a_known_layout(modules, tiny_model):
    *_, TrainerConfig = modules
    with pytest.raises(ValueError, match="lora_rank"):
        TrainerConfig(model_dir=str(tiny_model), lora_roles="a,b")
    with pytest.raises(ValueError, match="letters"):
        TrainerConfig(model_dir=str(tiny_model), lora_rank=4, lora_roles="a,b-c")
    with pytest.raises(ValueError, match="ZeRO"):
        TrainerConfig(model_dir=str(tiny_model), lora_rank=4, lora_roles="a,b", zero_stage=3)


# -- the trainer service, over real NATS ---------------------------------------------------------

@pytest.mark.integration
async def test_service_trains_both_role_adapters_and_dead_letters_an_unknown_role(tiny_model, tmp_path):
    from safetensors.torch import load_file

    from seamlessflow.stack import servers
    from services.trainer import audit
    from shared import bus, deadletter, subjects, weightstore
    from shared.checkpoint import role_adapters
    from shared.config import Connections
    from tests.integration.test_trainer_service import (GROUPS_PER_STEP, READY_TIMEOUT, Trainer, make_groups,
                                                        publish, trainer_env)

    port = servers.free_port()
    proc = servers.start_nats(port, tmp_path / "nats")
    url = f"nats://127.0.0.1:{port}"
    nc = await bus.connect(Connections(nats_url=url), name="multilora-test")
    try:
        js = nc.jetstream()
        await bus.ensure_streams(js, subjects.STREAMS)
        vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
        env = trainer_env(url, tmp_path, "trainer-multilora", SF_TRAINER_LORA_RANK="4",
                          SF_TRAINER_LORA_ROLES=",".join(ROLES), SF_TRAINER_PUBLISH_EVERY="1",
                          SF_TRAINER_CHECKPOINT_EVERY="1", SF_TRAINER_KEEP_VERSIONS="8", SF_TRAINER_LR="1e-2")
        groups = with_roles(make_groups("ml", 2 * GROUPS_PER_STEP, vocab, version=0, seed=5), ROLES)
        stray = msgspec.structs.replace(groups[0][0], session_id="stray", group_id="stray-g",
                                        metadata={"role": "critic"})
        await publish(nc, [t for g in groups for t in g] + [stray])
        trainer = Trainer.start(tiny_model, env, tmp_path / "trainer.log", "--max-steps", "2")
        await trainer.wait_for("trainer ready", READY_TIMEOUT)
        assert await trainer.wait_exit(120) == 0, trainer.text()[-4000:]
        text = trainer.text()
        assert "has no adapter" in text  # the critic's session: no such role, dead-lettered
        [letter] = await deadletter.recent(js)
        assert letter.subject == subjects.TRAJ_COMPLETED and "critic" in letter.error
        # both steps trained both roles (the step line carries each role's loss tokens)
        steps = [line for line in text.splitlines() if "roles=planner:" in line]
        assert len(steps) == 2 and all(",solver:" in line for line in steps), text[-3000:]
        # both adapters advance with every version
        store = tmp_path / "weights"
        assert weightstore.versions_on_disk(store) == [1, 2]
        v1, v2 = (role_adapters(weightstore.version_dir(store, v)) for v in (1, 2))
        assert sorted(v1) == sorted(v2) == sorted(ROLES)
        for role in ROLES:
            a = load_file(str(v1[role] / "adapter_model.safetensors"))
            b = load_file(str(v2[role] / "adapter_model.safetensors"))
            assert moved(a, b) > 0, f"{role}'s adapter did not advance from version 1 to 2"
        last = await weightstore.current(js)
        assert last.version == 2 and Path(last.path) == weightstore.version_dir(store, 2).resolve()
        ledger = audit.checkpoint_ledger(tmp_path / "ckpt")
        trained = sorted(t for ids in ledger.values() for t in ids)
        assert trained == sorted(t.session_id for g in groups for t in g)
    finally:
        await nc.close()
        servers.stop(proc)
        await asyncio.sleep(0)
