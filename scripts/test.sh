#!/usr/bin/env bash
# The README's test command: bootstrap .venv, lint (ruff), then run the default (CPU, non-slow) test suite.
# Extra arguments go to pytest (e.g. -m slow, -k masks).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
# lint + import order first (pyproject.toml [tool.ruff]); a failure stops before the tests
.venv/bin/ruff check --quiet . || { echo "error: ruff found problems (fix them, or run .venv/bin/ruff check --fix .)" >&2; exit 1; }
set +e
.venv/bin/python -m pytest -q -ra "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "error: pytest collected no tests" >&2; exit 1; fi
exit "$rc"
