#!/usr/bin/env bash
# Launch pretrain/pretrain.py on 1..N nodes with torchrun (default), the deepspeed launcher, mpirun or srun.
# The training layout (TP x PP x DP) comes from the config; this script only starts the processes.
#
#   ./launch.sh [options] [--] [pretrain.py arguments]
#
# Options (each also read from the environment variable in brackets):
#   --launcher L         torchrun | deepspeed | mpirun | srun [LAUNCHER, default torchrun]
#   --nnodes N           number of nodes                     [NNODES, default 1]
#   --node-rank R        this node's rank                    [NODE_RANK, default 0]
#   --nproc-per-node P   processes per node (GPUs, or CPU    [NPROC_PER_NODE or GPUS_PER_NODE, default 1]
#                        processes on a CPU machine)
#   --master-addr A      rendezvous host (node 0)            [MASTER_ADDR, default 127.0.0.1]
#   --master-port P      rendezvous port                     [MASTER_PORT, default 29500]
#   --max-restarts N     restart the job in place after a crash or a detected hang, resuming   [MAX_RESTARTS,
#                        from the newest complete checkpoint, up to N times (docs/guide/      default 0]
#                        multinode.md; setdiff_mega/resilience/supervisor.py)
#   --dry-run            print the command without running it
#
# Examples:
#   ./launch.sh --nproc-per-node 2 -- --config configs/tiny_cpu.yaml train.train_steps=100
#   # restarts itself from the newest checkpoint after a crash or a hung rank, up to 3 times
#   ./launch.sh --nproc-per-node 2 --max-restarts 3 -- --config configs/tiny_cpu.yaml
#   # two nodes (run on each, NODE_RANK=0 on the master):
#   NNODES=2 NODE_RANK=0 GPUS_PER_NODE=8 MASTER_ADDR=node0 ./launch.sh -- --config configs/owt_setdlm.yaml
#   # MPI (MPICH from the [mpi] extra): all ranks from one command; multi-node with HOSTS=node0,node1
#   ./launch.sh --launcher mpirun --nproc-per-node 2 -- --config configs/tiny_cpu.yaml
#   # inside a Slurm allocation (sbatch): one task per GPU, MASTER_ADDR = first node of the job
#   ./launch.sh --launcher srun --nnodes 2 --nproc-per-node 8 -- --config configs/owt_setdlm.yaml
#   # deepspeed launcher (multi-node reads HOSTFILE)
#   ./launch.sh --launcher deepspeed --nproc-per-node 2 -- --config configs/tiny_cpu.yaml train.zero_stage=2
set -euo pipefail
cd "$(dirname "$0")"

NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
NPROC=${NPROC_PER_NODE:-${GPUS_PER_NODE:-1}}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
LAUNCHER=${LAUNCHER:-torchrun}
MAX_RESTARTS=${MAX_RESTARTS:-0}
DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --nnodes) NNODES=$2; shift 2 ;;
    --node-rank) NODE_RANK=$2; shift 2 ;;
    --nproc-per-node) NPROC=$2; shift 2 ;;
    --master-addr) MASTER_ADDR=$2; shift 2 ;;
    --master-port) MASTER_PORT=$2; shift 2 ;;
    --launcher) LAUNCHER=$2; shift 2 ;;
    --max-restarts) MAX_RESTARTS=$2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,31p' "$0"; exit 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
for v in NNODES NODE_RANK NPROC MASTER_PORT MAX_RESTARTS; do
  if ! [[ ${!v} =~ ^[0-9]+$ ]]; then echo "error: $v must be a non-negative integer, got '${!v}'" >&2; exit 2; fi
done
if [ "$NODE_RANK" -ge "$NNODES" ]; then
  echo "error: NODE_RANK=$NODE_RANK must be smaller than NNODES=$NNODES" >&2; exit 2
fi
if [ "$NPROC" -lt 1 ] || [ "$NNODES" -lt 1 ]; then
  echo "error: NNODES and NPROC_PER_NODE must be >= 1" >&2; exit 2
fi

bin() { if [ -x ".venv/bin/$1" ]; then echo ".venv/bin/$1"; else echo "$1"; fi; }
PY=$(bin python)
case "$LAUNCHER" in
  torchrun)
    cmd=("$(bin torchrun)" --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$NPROC"
         --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" pretrain/pretrain.py "$@") ;;
  deepspeed)
    hostfile=()
    if [ "$NNODES" -gt 1 ]; then
      if [ -z "${HOSTFILE:-}" ]; then echo "error: the deepspeed launcher needs HOSTFILE for NNODES=$NNODES" >&2; exit 2; fi
      hostfile=(--hostfile "$HOSTFILE")
    fi
    cmd=("$(bin deepspeed)" "${hostfile[@]}" --num_nodes "$NNODES" --num_gpus "$NPROC" --master_addr "$MASTER_ADDR"
         --master_port "$MASTER_PORT" pretrain/pretrain.py "$@") ;;
  mpirun)
    hosts=()
    if [ -n "${HOSTS:-}" ]; then hosts=(-hosts "$HOSTS"); fi
    cmd=("$(bin mpiexec)" -n "$((NNODES * NPROC))" -ppn "$NPROC" "${hosts[@]}" -genv MASTER_ADDR "$MASTER_ADDR"
         -genv MASTER_PORT "$MASTER_PORT" "$PY" pretrain/pretrain.py "$@") ;;
  srun)
    if [ -z "${SLURM_JOB_ID:-}" ] && [ "$DRY" != 1 ]; then
      echo "error: --launcher srun runs inside a Slurm allocation (sbatch / salloc); SLURM_JOB_ID is not set" >&2; exit 2
    fi
    if [ -n "${SLURM_JOB_NODELIST:-}" ] && [ "$MASTER_ADDR" = 127.0.0.1 ] && command -v scontrol >/dev/null; then
      MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
    fi
    export MASTER_ADDR MASTER_PORT
    cmd=(srun --nodes "$NNODES" --ntasks-per-node "$NPROC" --kill-on-bad-exit=1 "$PY" pretrain/pretrain.py "$@") ;;
  *) echo "error: --launcher must be torchrun, deepspeed, mpirun or srun (got '$LAUNCHER')" >&2; exit 2 ;;
esac
if [ "$MAX_RESTARTS" -gt 0 ]; then
  cmd=("$PY" -m setdiff_mega.supervise --max-restarts "$MAX_RESTARTS" --node-rank "$NODE_RANK" -- "${cmd[@]}")
fi
echo "+ ${cmd[*]}" >&2
[ "$DRY" = 1 ] && exit 0
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} WANDB_MODE=${WANDB_MODE:-offline} TOKENIZERS_PARALLELISM=false
exec "${cmd[@]}"
