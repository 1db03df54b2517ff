"""A SIGKILLed trainer leaves no helper process behind (issue 16, defect 7): megatron-core's
checkpoint-writer manager, the writer processes it forks for a save and multiprocessing's resource
tracker exit with it. The kill lands while a save's forked writer is alive (the case that hung)."""
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


def _saved(save, step: int) -> bool:
    """A complete checkpoint of ``step`` or later exists (older ones are rotated out within ms)."""
    return any(int(p.parent.name[len("step_"):]) >= step for p in (save / "checkpoints").glob("step_*[0-9]/state.json"))


def _forked_writer(p: psutil.Process, trainer_cmdline: list) -> bool:
    try:
        return _alive(p) and p.cmdline() == trainer_cmdline          # a fork of the trainer: a save's writer
    except psutil.NoSuchProcess:
        return False


def test_kill_9_of_the_trainer_leaves_no_descendant(two_tokenizers, tmp_path):
    d, _, _ = two_tokenizers
    save, log = tmp_path / "run", tmp_path / "stderr.txt"        # a file: a full pipe would block the trainer
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    trainer = subprocess.Popen([sys.executable, "pretrain/pretrain.py", "--config", "configs/tiny_cpu.yaml", *TINY,
                                f"data.path={d / 'corpus'}", "train.train_steps=100000", "train.save_interval=2",
                                "train.eval_interval=100000", f"train.save_dir={save}"],
                               cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log.open("w"))
    helpers = []
    try:
        deadline = time.time() + 420                  # a slow CI machine: startup alone took ~120 s once
        while not _saved(save, 4):
            assert trainer.poll() is None, log.read_text()[-3000:]
            assert time.time() < deadline, f"no checkpoint within 420 s: {log.read_text()[-3000:]}"
            time.sleep(0.2)
        me = psutil.Process(trainer.pid)
        deadline = time.time() + 30
        while not any(_forked_writer(h, me.cmdline()) for h in me.children()):
            assert time.time() < deadline, "no save's writer process seen within 30 s"
        helpers = me.children(recursive=True)
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
