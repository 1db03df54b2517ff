"""Shared fixtures for the end-to-end tests: one tiny prepared corpus and one trained run per session, and
two ways to run a CLI: in a subprocess (``_run``: start-up, exit status and the whole stderr of a real
process) and in this process (``run_here``: the same ``main`` through the same CLI wrapper, without paying
the interpreter's and the libraries' start-up again; most e2e checks use it)."""
import contextlib
import functools
import importlib.util
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4", "data.seq_length=32",
        "train.micro_batch_size=4", "train.eval_iters=2", "train.eval_interval=5", "train.log_interval=2",
        "logging.wandb=disabled", "logging.progress=false", "train.warmup_steps=2"]


def _run(args, **kw):
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    kw.setdefault("timeout", 300)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, **kw)


@functools.cache
def tool(name: str):
    """The module of ``tools/<name>.py`` (imported once per session), with ``tools/`` on the path as running the
    script puts it (``tools/_checkout.py``: a test run alone found it only after another test had added it)."""
    if str(ROOT / "tools") not in sys.path:
        sys.path.insert(0, str(ROOT / "tools"))
    spec = importlib.util.spec_from_file_location(f"_tool_{name}", ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_here(args):
    """``["tools/x.py", *argv]`` run in this process: a CompletedProcess-like (returncode, stdout, stderr)."""
    from setdiff_mega.cli import run_cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = run_cli(tool(Path(args[0]).stem).main, [str(a) for a in args[1:]])
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "emb"
    r = _run(["tools/prepare_data.py", "--embedded", "--out", str(out), "--num-math", "300",
              "--num-stories", "300", "--vocab-size", "512"])
    assert r.returncode == 0, r.stderr
    assert (out / "corpus.bin").is_file() and (out / "corpus.manifest.json").is_file()
    assert (out / "tokenizer.json").is_file() and (out / "tasks" / "math.jsonl").is_file()
    r2 = _run(["tools/prepare_data.py", "--embedded", "--out", str(out), "--skip-existing"])
    assert r2.returncode == 0 and "skipping" in r2.stdout
    return out




@pytest.fixture(scope="session")
def trained_run(data_dir, tmp_path_factory):
    """A 12-step SetDLM run through the pretrain CLI: (save_dir, completed process)."""
    save = tmp_path_factory.mktemp("run") / "run"
    r = _run(["pretrain/pretrain.py", "--config", "configs/tiny_cpu.yaml", *TINY, "train.train_steps=12",
              f"data.path={data_dir / 'corpus'}", f"train.save_dir={save}", "train.save_interval=5"])
    assert r.returncode == 0, r.stderr[-3000:]
    return save, r
