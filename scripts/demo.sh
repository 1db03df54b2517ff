#!/usr/bin/env bash
# The README's main job: embedded corpus -> BPE tokenizer -> .bin/.idx -> train a tiny SetDLM on CPU
# -> checkpoint + validation loss -> samples (unconditional, math, infill). Extra arguments are passed to pretrain.py as dotted overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE="${WANDB_MODE:-offline}" TOKENIZERS_PARALLELISM=false
.venv/bin/python tools/prepare_data.py --embedded --out data/embedded --skip-existing
.venv/bin/python pretrain/pretrain.py --config configs/tiny_cpu.yaml "$@"
save_dir=$(.venv/bin/python pretrain/pretrain.py --config configs/tiny_cpu.yaml "$@" --print-config \
  | .venv/bin/python -c 'import json, sys; print(json.load(sys.stdin)["train"]["save_dir"])')
echo "== samples from the trained model (unconditional: the OWT protocol; math and infill: greedy, W = D, tau = 0.9) =="
.venv/bin/python tools/generate.py --checkpoint "$save_dir" --demo data/embedded/tasks --max-new-tokens 96 --batch-size 1
