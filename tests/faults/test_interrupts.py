"""Ctrl-C saves like SIGTERM (issue 28, defect 6): with the default train.save_interval=0, a run
interrupted near its end used to leave nothing to resume from. One Ctrl-C now saves at the end of the
step on every rank (also when it reaches one rank only, also under DeepSpeed ZeRO) and exits with status
130; a second Ctrl-C aborts at once."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ..distributed.harness import run_ranks
from ..distributed.test_parallel_training import _config
from .conftest import ROOT, TINY


def test_ctrl_c_saves_the_run_and_exits_130(data_dir, tmp_path):
    save = tmp_path / "run"
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    args = ["pretrain/pretrain.py", "--config", "configs/tiny_cpu.yaml", *TINY, "train.log_interval=1",
            f"data.path={data_dir / 'corpus'}", f"train.save_dir={save}"]
    proc = subprocess.Popen([sys.executable, *args, "train.train_steps=5000"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 420                  # a slow CI machine: startup alone took ~120 s once
        while time.time() < deadline and proc.poll() is None:
            f = save / "metrics.jsonl"
            if f.is_file() and any(json.loads(x).get("step", 0) >= 2 for x in f.read_text().splitlines()[:-1]):
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)                 # what Ctrl-C in the terminal sends
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, out[-3000:]
    done = sorted((save / "checkpoints").glob("step_???????"))
    assert len(done) == 1, out[-3000:]
    stopped = int(done[0].name.split("_")[1])
    assert 2 <= stopped < 5000 and f"SIGINT received: saved step {stopped}" in out and "Traceback" not in out
    assert json.loads((save / "summary.json").read_text())["stopped_by"] == "SIGINT"
    state = json.loads((done[0] / "state.json").read_text())       # a complete training checkpoint (resume: the
    assert state["kind"] == "training" and state["consumed_samples"] == 4 * stopped     # SIGTERM tests)


def test_a_second_ctrl_c_aborts_at_once():
    from setdiff_mega.training.signals import ExitSignals

    before = signal.getsignal(signal.SIGINT)            # default_int_handler; SIG_IGN under nohup / `cmd &`
    with ExitSignals() as signals:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)                                # the handler runs between bytecodes
        assert signals.received == signal.SIGINT and signals.agreed() == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
    assert signal.getsignal(signal.SIGINT) is before          # restored


def _interrupted(rank, world, data_dir, save_dir):
    """DeepSpeed ZeRO-2 on DP = 2; rank 1 alone gets SIGINT during step 2."""
    from setdiff_mega.training import optim, train

    real, calls = optim.lr_at, {"n": 0}

    def lr_at(step, tc):                                 # asked once per step, before its forward
        calls["n"] += 1
        if rank == 1 and calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return real(step, tc)
    optim.lr_at = lr_at
    try:
        res = train(_config(data_dir, save_dir, 1, 1, "setdlm", None, 2, zero=2,
                            extra=["train.train_steps=50", "train.save_interval=0"]), log=lambda *a: None)
    finally:
        optim.lr_at = real
    return {"stopped_by": res.stopped_by, "step": res.final_step, "checkpoint": res.checkpoint}


def test_ctrl_c_on_one_rank_saves_on_every_rank_under_zero(tiny_data, tmp_path):
    out = run_ranks(_interrupted, world=2, args=(tiny_data, tmp_path / "run"))
    assert out[0] == out[1] and out[0]["stopped_by"] == "SIGINT" and out[0]["step"] == 2, out
    ck = tmp_path / "run" / "checkpoints" / "step_0000002"
    assert out[0]["checkpoint"] == str(ck) and (ck / "state.json").is_file()
    shards = {p.name for p in (ck / "zero" / "state").iterdir()}       # each rank's ZeRO partition
    assert {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)} <= shards, shards


def test_sigterm_to_a_tool_stops_the_child_it_runs(tmp_path):
    """``timeout`` or a supervisor sends SIGTERM to the tool only: a study waiting in ``subprocess.run`` on its
    training child used to die at once and leave the child training, orphaned. run_cli raises it as an exception,
    so subprocess.run kills the child, and the tool exits 143 with one line."""
    pid_file = tmp_path / "child.pid"
    child = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    tool = ("import subprocess, sys\nfrom setdiff_mega.cli import run_cli\n"
            f"sys.exit(run_cli(lambda argv: subprocess.run([sys.executable, '-c', {child!r}])))\n")
    proc = subprocess.Popen([sys.executable, "-c", tool], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not (pid_file.is_file() and pid_file.read_text()):
            time.sleep(0.1)
        child_pid = int(pid_file.read_text())
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143 and "terminated (SIGTERM)" in err, err[-2000:]
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            os.kill(child_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(child_pid, signal.SIGKILL)
        pytest.fail("the child outlived the tool")


def test_a_forked_worker_still_dies_of_sigterm(tmp_path):
    """A multiprocessing pool ends its workers with SIGTERM: a worker forked from a tool inherits run_cli's handler
    and must die of the signal as before (unwinding there hung tools/preprocess_data.py's pool)."""
    script = ("import multiprocessing as mp, os, signal, sys, time\n"
              "from setdiff_mega.cli import terminate_as_interrupt\nterminate_as_interrupt()\n"
              "ctx = mp.get_context('fork')\n"
              "p = ctx.Process(target=time.sleep, args=(60,)); p.start(); time.sleep(0.5)\n"
              "os.kill(p.pid, signal.SIGTERM); p.join(10); print(p.exitcode)\n")
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == str(-signal.SIGTERM), r.stdout + r.stderr[-2000:]
