#!/usr/bin/env bash
# The reference implementation's own environment, for tools/bench_reference.py (issue 44).
#
#   scripts/setup_reference.sh REF_DIR [VENV]      # VENV defaults to .venv-ref (git-ignored)
#
# REF_DIR is an unmodified work tree of kuleshov-group/setdlms (it must hold src/denoiser/setdlm.py); nothing
# is installed from it: the benchmark's worker puts REF_DIR on sys.path at run time. The venv gets the pinned
# versions below from the package registry only (no model or data downloads):
#   torch 2.13.0         the same wheel as the project's .venv (the CPU build on the project machines, through
#                        pip's find-links), so both sides run the same kernels; elsewhere pass the CPU index with
#                        PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
#   transformers 4.52.4  the reference's pin: its SetDLM reads DynamicCache.key_cache / value_cache, which
#                        transformers 5 removed (the project's .venv has 5.x)
#   hydra-core 1.3.2, einops 0.8.1   the reference's pins (its Denoiser builds the backbone and the noise
#                        schedule with hydra.utils.instantiate)
# Idempotent: reinstalls only when the pins change; ends with an import check of the reference's SetDLM.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"

if [ $# -lt 1 ] || [ $# -gt 2 ]; then
  echo "usage: scripts/setup_reference.sh REF_DIR [VENV]   (REF_DIR: a work tree of kuleshov-group/setdlms)" >&2
  exit 2
fi
REF_DIR="$(cd "$1" 2>/dev/null && pwd)" || { echo "error: REF_DIR '$1' is not a directory" >&2; exit 2; }
if [ ! -f "$REF_DIR/src/denoiser/setdlm.py" ] || [ ! -f "$REF_DIR/src/backbone/dit.py" ]; then
  echo "error: '$REF_DIR' is not a setdlms work tree (no src/denoiser/setdlm.py or src/backbone/dit.py)" >&2
  exit 2
fi
VENV="${2:-$ROOT/.venv-ref}"

PINS=(torch==2.13.0 transformers==4.52.4 tokenizers==0.21.4 huggingface-hub==0.36.0 safetensors==0.6.2
      hydra-core==1.3.2 omegaconf==2.3.0 einops==0.8.1 numpy==2.2.6 tqdm==4.67.1)

source "$ROOT/scripts/find_python.sh"

start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  PY=$(find_python "the reference environment (the project's torch wheel)")
  echo "[setup_reference] creating $VENV with $PY"
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.setdiff-reference-installed"
want=$(printf '%s\n' "${PINS[@]}" | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[setup_reference] installing ${PINS[*]}"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${PINS[@]}" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  echo "$want" > "$stamp"
fi
echo "[setup_reference] checking that the reference imports from $REF_DIR"
PYTHONPATH="$REF_DIR" HF_HUB_OFFLINE=1 "$VENV/bin/python" -c '
import torch, transformers
from src.denoiser.setdlm import SetDLM  # noqa: F401
from src.backbone.dit import DIT  # noqa: F401
print(f"[setup_reference] ok: torch {torch.__version__}, transformers {transformers.__version__}")'
echo "[setup_reference] done in $(( $(date +%s) - start )) s; run: tools/bench_reference.py --ref-dir $REF_DIR --ref-venv $VENV"
