"""launch.sh: command construction for every launcher, argument errors, and real 2-process runs on localhost
(two torchrun "nodes", mpirun, the deepspeed launcher with ZeRO-2)."""
import json
import os
import socket
import subprocess

import pytest

from .conftest import ROOT, TINY


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**kw):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(HF_HUB_OFFLINE="1", WANDB_MODE="disabled", OMP_NUM_THREADS="1", **kw)
    return env


def test_dry_run_prints_the_torchrun_command():
    r = subprocess.run(["bash", "launch.sh", "--dry-run", "--nproc-per-node", "2", "--", "--config", "x.yaml",
                        "train.lr=1e-3"], cwd=ROOT, env=_env(NNODES="1"), capture_output=True, text=True)
    assert r.returncode == 0
    line = r.stderr.strip().splitlines()[-1]
    assert "torchrun --nnodes 1 --node_rank 0 --nproc_per_node 2 --master_addr 127.0.0.1" in line
    assert line.endswith("pretrain/pretrain.py --config x.yaml train.lr=1e-3")


def test_bad_layout_is_rejected_before_launch():
    r = subprocess.run(["bash", "launch.sh", "--dry-run"], cwd=ROOT, env=_env(NNODES="2", NODE_RANK="2"),
                       capture_output=True, text=True)
    assert r.returncode == 2 and "NODE_RANK=2 must be smaller than NNODES=2" in r.stderr


def test_two_nodes_on_localhost_train_data_parallel(data_dir, tmp_path):
    port = str(_port())
    save = tmp_path / "run"
    args = ["--config", "configs/tiny_cpu.yaml", *TINY, "train.train_steps=6", f"data.path={data_dir / 'corpus'}",
            f"train.save_dir={save}"]
    procs = [subprocess.Popen(["bash", "launch.sh", "--", *args], cwd=ROOT,
                              env=_env(NNODES="2", NODE_RANK=str(r), NPROC_PER_NODE="1", MASTER_PORT=port),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    summary = json.loads(outs[0][0].strip().splitlines()[-1])
    assert summary["final_val_loss"] < summary["initial_val_loss"]
    state = json.loads((save / "checkpoints" / "step_0000006" / "state.json").read_text())
    assert state["data_parallel_size"] == 2
    assert state["consumed_samples"] == 6 * 4 * 2          # two ranks read disjoint micro-batches
    assert "done:" not in outs[1][0] + outs[1][1]          # only rank 0 reports


@pytest.mark.slow            # CP = 2 against one process is in the default suite (tests/distributed)
def test_torchrun_context_parallel_run(data_dir, tmp_path):
    """CP = 2 under a real torchrun: both ranks read the same samples (DP = 1) and hold half of each stream,
    attending with the set-causal decomposition per chunk (no mask)."""
    save = tmp_path / "run"
    args = ["--config", "configs/tiny_cpu.yaml", *TINY, "train.train_steps=6", f"data.path={data_dir / 'corpus'}",
            f"train.save_dir={save}", "parallel.context_parallel_size=2", "model.attention_backend=setcausal"]
    r = subprocess.run(["bash", "launch.sh", "--", *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=_env(NNODES="1", NODE_RANK="0", NPROC_PER_NODE="2", MASTER_PORT=str(_port())))
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["final_val_loss"] < summary["initial_val_loss"]
    state = json.loads((save / "checkpoints" / "step_0000006" / "state.json").read_text())
    assert state["context_parallel_size"] == 2 and state["data_parallel_size"] == 1
    assert state["consumed_samples"] == 6 * 4              # the CP ranks share every sample
    assert "CP=2 PP=1 DP=1" in r.stdout + r.stderr


def test_dry_run_commands_for_every_launcher():
    def cmd(*args, **env):
        r = subprocess.run(["bash", "launch.sh", "--dry-run", *args, "--", "x=1"], cwd=ROOT, env=_env(**env),
                           capture_output=True, text=True)
        return r.returncode, r.stderr.strip().splitlines()[-1]

    rc, line = cmd("--launcher", "mpirun", "--nnodes", "2", "--nproc-per-node", "4", HOSTS="n0,n1", MASTER_ADDR="n0")
    assert rc == 0 and "mpiexec -n 8 -ppn 4 -hosts n0,n1 -genv MASTER_ADDR n0" in line and line.endswith("x=1")
    rc, line = cmd("--launcher", "deepspeed", "--nproc-per-node", "2")
    assert rc == 0 and "deepspeed --num_nodes 1 --num_gpus 2" in line
    rc, line = cmd("--launcher", "srun", "--nnodes", "2", "--nproc-per-node", "8")
    assert rc == 0 and line.startswith("+ srun --nodes 2 --ntasks-per-node 8")
    rc, line = cmd("--launcher", "deepspeed", "--nnodes", "2")
    assert rc == 2 and "needs HOSTFILE" in line
    rc, line = cmd("--launcher", "nope")
    assert rc == 2 and "must be torchrun, deepspeed, mpirun or srun" in line


@pytest.mark.parametrize("launcher,extra", [("mpirun", []),
                                            # slow: ZeRO-2 itself is in the default suite (tests/distributed)
                                            pytest.param("deepspeed", ["train.zero_stage=2"], marks=pytest.mark.slow)])
def test_mpirun_and_deepspeed_launchers_train(data_dir, tmp_path, launcher, extra):
    save = tmp_path / launcher
    args = ["--config", "configs/tiny_cpu.yaml", *TINY, "train.train_steps=4", f"data.path={data_dir / 'corpus'}",
            f"train.save_dir={save}", *extra]
    r = subprocess.run(["bash", "launch.sh", "--launcher", launcher, "--nproc-per-node", "2", "--", *args], cwd=ROOT,
                       env=_env(MASTER_PORT=str(_port())), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    summaries = [x for x in r.stdout.splitlines() if x.startswith('{"final_step"')]
    assert len(summaries) == 1                                  # rank 0 only
    state = json.loads((save / "checkpoints" / "step_0000004" / "state.json").read_text())
    assert state["data_parallel_size"] == 2 and state["zero_stage"] == (2 if extra else 0)


def test_launcher_environment_discovery():
    from setdiff_mega.parallel import discover_launcher_env

    assert discover_launcher_env({}) is None
    mpich = discover_launcher_env({"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MASTER_ADDR": "n0"})
    assert mpich == {"launcher": "mpich", "RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "n0",
                     "MASTER_PORT": "29500"}
    ompi = discover_launcher_env({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8",
                                  "OMPI_COMM_WORLD_LOCAL_RANK": "1"})
    assert (ompi["launcher"], ompi["RANK"], ompi["WORLD_SIZE"], ompi["LOCAL_RANK"]) == ("openmpi", "3", "8", "1")
    slurm = discover_launcher_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "5",
                                   "MASTER_PORT": "1234"})
    assert (slurm["launcher"], slurm["RANK"], slurm["MASTER_PORT"]) == ("slurm", "5", "1234")
    tr = discover_launcher_env({"RANK": "0", "WORLD_SIZE": "2", "PMI_RANK": "1", "PMI_SIZE": "2"})
    assert tr["launcher"] == "torchrun/deepspeed" and tr["RANK"] == "0"   # explicit RANK wins
