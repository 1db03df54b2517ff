"""Kill-and-resume under torchrun (2 ranks, gloo, fp32): a run killed by SIGKILL in the middle of training,
or in the middle of a save, resumes from the last complete checkpoint, and its losses equal those of an
uninterrupted run bit for bit. Also: SIGTERM saves and stops cleanly."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from .conftest import ROOT, TINY

STEPS = 12


def _args(data_dir, save, extra=()):
    return ["--nproc_per_node", "2", "pretrain/pretrain.py", "--config", "configs/tiny_cpu.yaml", *TINY,
            f"train.train_steps={STEPS}", "train.log_interval=1", "train.eval_interval=4", "train.save_interval=3",
            "train.keep_last=3", f"data.path={data_dir / 'corpus'}", f"train.save_dir={save}", "train.lr=3e-3",
            "model.zero_init_head=false", *extra]


def _env(**extra):
    return dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="disabled", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                **extra)


class Job:
    """A torchrun job whose output goes to files (no pipes for leftover helper processes to hold open)."""

    def __init__(self, args, log_dir, **env):
        log_dir.mkdir(parents=True, exist_ok=True)
        n = len(list(log_dir.glob("job*.out")))
        self.out_path, self.err_path = log_dir / f"job{n}.out", log_dir / f"job{n}.err"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--master_port",
                                          str(_port()), *args], cwd=ROOT, env=_env(**env), stdout=out, stderr=err)

    def kill_all(self, sig=signal.SIGKILL):
        """Signal torchrun and every process under it (torchrun starts each worker in its own session)."""
        import psutil

        try:
            procs = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            procs = []
        for p in [psutil.Process(self.proc.pid)] + procs if self.proc.poll() is None else procs:
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass

    def wait(self, timeout=300):
        try:
            rc = self.proc.wait(timeout=timeout)
        finally:
            self.kill_all()
        return rc

    @property
    def output(self):
        return self.out_path.read_text() + self.err_path.read_text()


def _torchrun(args, log_dir, **env):
    job = Job(args, log_dir, **env)
    return job.wait(), job.output


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rows(save):
    """step -> metrics of the final metrics.jsonl (a resumed run has rewritten what followed its checkpoint)."""
    out = {}
    for line in (save / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        key = "val" if "val/loss" in rec else "train"
        assert (rec["step"], key) not in out, f"step {rec['step']} logged twice"
        out[(rec["step"], key)] = rec
    return out


def _max_step(save) -> int:
    """Newest logged step of a running job (tolerates a line being written)."""
    f = save / "metrics.jsonl"
    steps = [0]
    for line in (f.read_text().splitlines() if f.is_file() else []):
        try:
            steps.append(json.loads(line)["step"])
        except (json.JSONDecodeError, KeyError):
            pass
    return max(steps)


def _losses(save):
    rows = _rows(save)
    return {k: (r.get("train/loss"), r.get("train/grad_norm"), r.get("val/loss")) for k, r in rows.items()}


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory):
    save = tmp_path_factory.mktemp("resume") / "ref"
    rc, out = _torchrun(_args(data_dir, save), save.parent / "logs")
    assert rc == 0, out[-3000:]
    return _losses(save)


def test_sigkill_in_a_save_then_in_training_resumes_exactly(data_dir, tmp_path, reference):
    save = tmp_path / "run"
    ck = save / "checkpoints"
    # 1) rank 0 dies by SIGKILL inside the save of step 6: shards written, the checkpoint never published
    rc, out = _torchrun(_args(data_dir, save), tmp_path / "logs", SETDIFF_MEGA_FAULT="kill_in_save:6")
    assert rc != 0, out[-3000:]
    assert (ck / "step_0000006.tmp").is_dir() and not (ck / "step_0000006").exists()
    assert (ck / "latest").read_text().strip() == "step_0000003"

    # 2) resume (train.resume=auto is the default) from step 3; SIGKILL the whole job during training
    job = Job(_args(data_dir, save), tmp_path / "logs")
    deadline = time.time() + 240
    try:
        while time.time() < deadline and job.proc.poll() is None:
            if (ck / "step_0000006").is_dir() and _max_step(save) >= 8:
                break
            time.sleep(0.05)
        assert job.proc.poll() is None, f"the run ended before it could be killed: {job.output[-2000:]}"
        job.kill_all(signal.SIGKILL)
    finally:
        job.wait(timeout=60)
    assert not (ck / "step_0000006.tmp").exists()       # the next save cleared the interrupted one
    killed_at = max(k[0] for k in _rows(save))
    assert killed_at < STEPS

    # 3) resume again to the end: every logged loss equals the uninterrupted run's
    rc, out = _torchrun(_args(data_dir, save), tmp_path / "logs")
    assert rc == 0, out[-3000:]
    assert "resumed from" in out
    assert _losses(save) == reference
    assert (ck / "latest").read_text().strip() == f"step_{STEPS:07d}"


def test_sigterm_saves_and_stops_then_resumes_exactly(data_dir, tmp_path, reference):
    save = tmp_path / "run"
    job = Job(_args(data_dir, save, ["train.save_interval=0"]), tmp_path / "logs")
    deadline = time.time() + 240
    while time.time() < deadline and job.proc.poll() is None:
        if _max_step(save) >= 2:
            break
        time.sleep(0.05)
    job.kill_all(signal.SIGTERM)         # what a scheduler sends before a kill, to every process of the job
    job.wait(timeout=120)
    done = sorted((save / "checkpoints").glob("step_???????"))
    assert len(done) == 1, job.output[-3000:]
    stopped = int(done[0].name.split("_")[1])
    assert 2 <= stopped < STEPS and "SIGTERM received: saved step" in job.output
    rc, out = _torchrun(_args(data_dir, save, ["train.save_interval=0"]), tmp_path / "logs")
    assert rc == 0, out[-3000:]
    assert _losses(save) == reference


def test_async_saves_resume_exactly_and_a_kill_in_flight_publishes_nothing(data_dir, tmp_path, reference):
    """train.async_save=true: rank 0 SIGKILLed right after its step-6 writers were scheduled leaves step 6
    unpublished (step 3, saved asynchronously, is the newest complete one); resuming with async saves to the
    end logs the uninterrupted synchronous run's losses bit for bit."""
    save, logs, asy = tmp_path / "run", tmp_path / "logs", ["train.async_save=true"]
    ck = save / "checkpoints"
    rc, out = _torchrun(_args(data_dir, save, asy), logs, SETDIFF_MEGA_FAULT="kill_in_save:6")
    assert rc != 0, out[-3000:]
    assert not (ck / "step_0000006").exists() and (ck / "step_0000003" / "state.json").is_file()
    rc, out = _torchrun(_args(data_dir, save, asy), logs)
    assert rc == 0, out[-3000:]
    assert "resumed from" in out and "step_0000003" in out
    # training went on while step 9 was written: published after 1-3 further steps (the save at 12 waits)
    assert re.search(r"step_0000009 \(written asynchronously, [123] training step\(s\) after it was scheduled", out)
    assert _losses(save) == reference
    assert (ck / "latest").read_text().strip() == f"step_{STEPS:07d}"
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_0000006", "step_0000009", "step_0000012"]
