"""The restart supervisor and the straggler report around the real trainer (issue 42): a restart never trains
past a corrupt checkpoint (the integrity checks stay in force: the job stops, the checkpoint is left as it
is), and a rank made slow on purpose is named by the straggler report."""
import json
import os
import socket
import subprocess
import sys

from .conftest import ROOT, TINY


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SETDIFF_CHAOS")}
    env.update(HF_HUB_OFFLINE="1", WANDB_MODE="disabled", OMP_NUM_THREADS="1", **extra)
    return env


def test_a_restart_never_trains_past_a_corrupt_checkpoint(two_tokenizers, tmp_path):
    d, _, _ = two_tokenizers
    save = tmp_path / "run"
    args = [sys.executable, "pretrain/pretrain.py", "--config", "configs/tiny_cpu.yaml", *TINY,
            "train.save_interval=2", "train.keep_last=0", f"data.path={d / 'corpus'}", f"train.save_dir={save}"]
    r = subprocess.run([*args, "train.train_steps=4"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    ck = save / "checkpoints" / "step_0000004"
    shard = max((ck / "dist").glob("*.distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    shard.write_bytes(bytes(raw))
    before = {p: p.read_bytes() for p in ck.rglob("*") if p.is_file()}
    r = subprocess.run([sys.executable, "-m", "setdiff_mega.supervise", "--max-restarts", "3",
                        "--restart-delay", "0", "--", *args, "train.train_steps=8"], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"checkpoint file '{shard}' does not match the SHA-256" in r.stderr
    assert "supervisor: the job was refused" in r.stderr and "supervisor: restart" not in r.stderr
    assert {p: p.read_bytes() for p in ck.rglob("*") if p.is_file()} == before      # left as it was
    assert sorted(p.name for p in (save / "checkpoints").glob("step_*")) == ["step_0000002", "step_0000004"]


def test_a_slow_rank_is_named_by_the_straggler_report(two_tokenizers, tmp_path):
    d, _, _ = two_tokenizers
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps([{"id": "slow", "kind": "slow", "step": 0, "rank": 1, "seconds": 0.3}]))
    save = tmp_path / "run"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run(["bash", "launch.sh", "--nproc-per-node", "2", "--master-port", str(port), "--",
                        "--config", "configs/tiny_cpu.yaml", *TINY, "train.train_steps=8", "train.log_interval=2",
                        "fault.straggler_patience=2", f"data.path={d / 'corpus'}", f"train.save_dir={save}"],
                       cwd=ROOT, env=_env(SETDIFF_CHAOS=str(plan)), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    stats = [x for x in rows if "straggler/slowest_rank" in x]
    assert len(stats) == 4 and all(x["straggler/slowest_rank"] == 1 for x in stats), stats
    assert all(x["straggler/max_s"] - x["straggler/min_s"] > 0.2 for x in stats)
    warnings = [line for line in (r.stdout + r.stderr).splitlines() if "warning: straggler" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: straggler: rank 1 has taken"), warnings
