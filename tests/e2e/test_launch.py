"""launch.sh: command construction, argument errors, and a real 2-node data-parallel run on localhost."""
import json
import os
import socket
import subprocess


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
