#!/usr/bin/env bash
# The GPU check of issue 8, as one script (about 6 minutes on one H100 / H200; at most 8).
#
#   here, where pip can reach the registry:   bash scripts/gpu_check.sh fetch
#       downloads the wheels the GPU machine lacks into .whl/ (git-ignored; ~6 MB): megatron-core and
#       torchao for CPython $GPU_PYTHON (default 3.12). The machine must already have CUDA PyTorch >= 2.6.
#   on the GPU machine, with .whl/ copied over:   bash scripts/gpu_check.sh run [OUT_DIR]
#       installs .whl/*.whl into /tmp/site without an index, then
#         1. pytest -m gpu tests/gpu: the attention backends agree in bf16 with an fp32 dense-mask reference
#            (outputs and gradients; inside the model with padding and pinned context), torchao FP8 trains
#            within 5% of bf16;
#         2. tools/bench_train_gpu.py: ~350M model, L = 1024 and 2048: step time, MFU, tokens/s for AR
#            (causal), SetDLM x {dense-mask SDPA, FlexAttention, set-causal decomposition}, with FP8; and
#            set-causal attention fwd+bwd vs two causal calls (CSV rows are written as they finish, so a
#            timeout keeps what ran).
#       Logs, CSV, JSON and the PNG go to OUT_DIR (default runs/gpu_check). Exit status: pytest's, or the
#       benchmark's if pytest passed.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-run}
GPU_PYTHON=${GPU_PYTHON:-3.12}

if [ "$mode" = fetch ]; then
  mkdir -p .whl
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  python3 -m pip download --no-deps --only-binary=:all: --python-version "$GPU_PYTHON" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl megatron-core==0.16.1 torchao==0.18.0
  ls -la .whl
  exit $?
fi
if [ "$mode" != run ]; then
  echo "usage: bash scripts/gpu_check.sh fetch | run [OUT_DIR]" >&2
  exit 2
fi

out=${2:-${OUT:-runs/gpu_check}}
mkdir -p "$out"
if ! ls .whl/*.whl >/dev/null 2>&1; then
  echo "error: no wheels in .whl/; run 'bash scripts/gpu_check.sh fetch' where pip works and copy .whl/ here" >&2
  exit 2
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
python3 - <<'PY' 2>&1 | tee "$out/env.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(),
      "capability", torch.cuda.get_device_capability())
import megatron.core, torchao
print("megatron-core", megatron.core.__version__, "torchao", torchao.__version__)
PY
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee -a "$out/env.txt"

start=$(date +%s)
timeout 180 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider -o addopts="" 2>&1 | tee "$out/pytest_gpu.log"
test_rc=${PIPESTATUS[0]}
echo "[gpu_check] tests rc=$test_rc in $(( $(date +%s) - start )) s"

left=$(( 440 - ($(date +%s) - start) ))          # the whole check stays under 8 minutes
timeout "$left" python3 tools/bench_train_gpu.py --preset 350m --seq-lengths 1024 2048 --warmup 3 --iters 8 \
  --out-dir "$out" 2>&1 | tee "$out/bench.log"
bench_rc=${PIPESTATUS[0]}
echo "[gpu_check] benchmark rc=$bench_rc; total $(( $(date +%s) - start )) s; results in $out"
[ "$test_rc" -ne 0 ] && exit "$test_rc"
exit "$bench_rc"
