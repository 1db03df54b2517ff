"""A SIGKILLed trainer leaves no helper process behind (issue 16, defect 7): megatron-core's
checkpoint-writer manager and multiprocessing's resource tracker exit with it."""
import os
import signal
import subprocess
import sys
import time

import psutil

from .conftest import ROOT, TINY


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_kill_9_of_the_trainer_leaves_no_descendant(two_tokenizers, tmp_path):
    d, _, _ = two_tokenizers
    save = tmp_path / "run"
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    trainer = subprocess.Popen([sys.executable, "pretrain/pretrain.py", "--config", "configs/tiny_cpu.yaml", *TINY,
                                f"data.path={d / 'corpus'}", "train.train_steps=100000", "train.save_interval=2",
                                "train.eval_interval=100000", f"train.save_dir={save}"],
                               cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    helpers = []
    try:
        deadline = time.time() + 120
        while not (save / "checkpoints" / "step_0000004" / "state.json").is_file():   # saves have run
            assert trainer.poll() is None, trainer.stderr.read()[-3000:]
            assert time.time() < deadline, "no checkpoint within 120 s"
            time.sleep(0.2)
        helpers = psutil.Process(trainer.pid).children(recursive=True)
        assert helpers, "expected the checkpoint-writer helper processes"
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait(30)
        deadline = time.time() + 20
        while any(_alive(h) for h in helpers) and time.time() < deadline:
            time.sleep(0.2)
        left = [(h.pid, " ".join(h.cmdline())[:120]) for h in helpers if _alive(h)]
        assert not left, f"helpers outlived the SIGKILLed trainer: {left}"
    finally:
        if trainer.poll() is None:
            trainer.kill()
        for h in helpers:                   # never leave them behind, even when the test fails
            try:
                h.kill()
            except psutil.NoSuchProcess:
                pass
