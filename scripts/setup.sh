#!/usr/bin/env bash
# Create (or reuse) the project-local virtual environment .venv with everything the CPU path needs.
# Idempotent: reinstalls only when pyproject.toml changed since the last successful install.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/find_python.sh

PY=$(find_python "setdiff-mega (megatron-core 0.16.1 and the CPU torch wheel)")
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $PY"
  "$PY" -m venv .venv
fi
stamp=.venv/.setdiff-mega-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[setup] installing setdiff-mega and its pinned dependencies into .venv (one time, ~2 min)"
  # (the filter hides pip's notices about absent local index folders on the project machines)
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[dev,mpi,eval,fp8]" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  echo "$want" > "$stamp"
fi

# Chromium and its driver for the playground's browser test (tests/e2e/test_playground_browser.py), from the
# distribution's packages; without root and apt-get (or where they cannot be installed) that test is skipped
# with the reason.
if ! command -v chromedriver >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO="sudo -n"; fi
  if $SUDO true 2>/dev/null; then
    echo "[setup] installing chromium and chromium-driver (the playground's browser test)"
    if ! { $SUDO apt-get install -y --no-install-recommends chromium chromium-driver >/dev/null 2>&1 ||
           { $SUDO apt-get update >/dev/null 2>&1 &&
             $SUDO apt-get install -y --no-install-recommends chromium chromium-driver >/dev/null 2>&1; }; }; then
      echo "[setup] could not install chromium: the browser test will be skipped" >&2
    fi
  fi
fi
