"""A run directory belongs to one run, and the data a run reads is the data on disk (issue 28, defects
3, 4, 7 and 8): a new run over an older one is refused unless asked to replace it, two runs in one
directory are refused while the first holds it (and a killed run leaves no stale lock), a dataset
re-preprocessed under the same prefix is never read through the old index cache, and a dataset too small
for a sample is refused before megatron-core loops forever on it."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from .conftest import ROOT, TINY, kept, one_line_error, run_tool, snapshot


def _cfg(data_dir, save, *extra):
    from setdiff_mega.config import load_config

    return load_config(ROOT / "configs/tiny_cpu.yaml", [*TINY, f"data.path={data_dir / 'corpus'}",
                                                         f"train.save_dir={save}", *extra])


def test_a_new_run_over_an_older_one_is_refused_and_overwrite_leaves_only_the_new_history(
        trained_run, data_dir, tmp_path, mcore):
    """Defect 4: after `train.resume=none` in a directory with an older SetDLM run, every tool loaded the
    old run, and keep_last deleted the new run's checkpoint while keeping the old one."""
    from setdiff_mega.checkpoint import CheckpointError, latest_checkpoint, load_model
    from setdiff_mega.training import train

    save, _ = trained_run
    run = tmp_path / "run"
    shutil.copytree(save, run)
    before = snapshot(run)
    new = ("objective.name=ar", "train.resume=none", "train.train_steps=4", "train.save_interval=2")
    with pytest.raises(CheckpointError, match="holds checkpoints of another run history .* train.overwrite=true"):
        train(_cfg(data_dir, run, *new), log=lambda *a: None)
    kept(before, run)
    assert set(snapshot(run)) == set(before)
    train(_cfg(data_dir, run, *new, "train.overwrite=true"), log=lambda *a: None)
    steps = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    assert steps == ["step_0000002", "step_0000004"]                  # keep_last kept the new run's steps
    assert latest_checkpoint(run).name == "step_0000004"
    assert load_model(run)[3].objective.name == "ar"
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()][0] == 0


def test_resuming_an_older_checkpoint_of_the_directory_is_refused_while_newer_ones_exist(trained_run, tmp_path,
                                                                                          data_dir, mcore):
    from setdiff_mega.checkpoint import CheckpointError
    from setdiff_mega.training import train

    save, _ = trained_run
    run = tmp_path / "run"
    shutil.copytree(save, run)
    older = sorted((run / "checkpoints").glob("step_*"))[0]
    with pytest.raises(CheckpointError, match="resumes the older 'step_0000010'.*mix two histories"):
        train(_cfg(data_dir, run, f"train.resume={older}", "train.train_steps=12"), log=lambda *a: None)


def _launch(data_dir, save, steps):
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    args = ["pretrain/pretrain.py", "--config", "configs/tiny_cpu.yaml", *TINY, f"train.train_steps={steps}",
            f"data.path={data_dir / 'corpus'}", f"train.save_dir={save}", "train.log_interval=1"]
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL), args


def test_a_second_run_in_the_same_directory_is_refused_and_a_killed_run_leaves_no_stale_lock(data_dir, tmp_path):
    """Defect 7: two runs started seconds apart both trained into one save_dir (interleaved metrics, racing
    saves, a misleading error)."""
    from setdiff_mega.outputs import RunLock

    save = tmp_path / "run"
    first, args = _launch(data_dir, save, 2000)
    try:
        deadline = time.time() + 420                  # a slow CI machine: startup alone took ~120 s once
        while time.time() < deadline and first.poll() is None and not (save / "metrics.jsonl").is_file():
            time.sleep(0.1)
        assert first.poll() is None, "the first run ended before the second started"
        r = run_tool(args)
        one_line_error(r, f"train.save_dir '{save}' is in use by another run (PID {first.pid} on host",
                       "one run at a time")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    lock = RunLock(save).acquire()                # kill -9 left no stale lock: the kernel released it
    lock.release()
    assert len([json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]) >= 1


def _dataset(prefix, tok_path, n_docs):
    from setdiff_mega.data.preprocess import preprocess

    raw = prefix.parent / f"raw{n_docs}.jsonl"
    raw.write_text("".join(json.dumps({"text": f"Question: Sam has {i} apples and {i % 7} pears. How many? "
                                               f"Answer: {i + i % 7}."}) + "\n" for i in range(n_docs)))
    preprocess([str(raw)], str(prefix), str(tok_path), workers=1, progress=False, log=lambda *a: None,
               overwrite=True)


def test_a_dataset_preprocessed_again_under_the_same_prefix_is_never_read_through_the_old_index(data_dir,
                                                                                                 tmp_path):
    """Defect 3: the index cache was keyed by the path: 2,000 documents written over 1,000 trained on half of
    them (2,737 instead of 5,418 samples), silently; fewer documents ended in an IndexError."""
    from setdiff_mega.data import Tokenizer
    from setdiff_mega.data.loader import build_splits

    tok_path = data_dir / "tokenizer.json"
    tok = Tokenizer.from_file(tok_path)
    prefix = tmp_path / "d" / "corpus"
    prefix.parent.mkdir()

    def sizes(cache=None, log=lambda *a: None):
        tr, va, _ = build_splits(str(prefix), tok, 32, "90,10,0", 1, (1, 1, 0), cache, log=log)
        return len(tr), len(va)

    _dataset(prefix, tok_path, 1000)
    first = sizes()
    for n in (2000, 400):
        _dataset(prefix, tok_path, n)
        notes = []
        got = sizes(log=notes.append)
        assert got == sizes(tmp_path / f"fresh{n}") and got != first
        assert len(notes) == 1 and f"'{prefix}' holds other data than when the index cache" in notes[0]
    assert sizes() == got                                         # the new cache is reused: no second note


@pytest.mark.timeout(120)
def test_a_dataset_too_small_for_a_sample_is_refused_before_megatron_core_builds_anything(data_dir, tmp_path):
    """Defect 8: a 10-document dataset hung training forever (megatron-core's GPTDataset._get_num_epochs loops
    on an empty split)."""
    from setdiff_mega.data import Tokenizer
    from setdiff_mega.data.indexed import DataError
    from setdiff_mega.data.loader import build_splits

    tok = Tokenizer.from_file(data_dir / "tokenizer.json")
    prefix = tmp_path / "ten"
    _dataset(prefix, data_dir / "tokenizer.json", 10)
    with pytest.raises(DataError, match=r"its valid split gets 0 of its 10 documents \(0 tokens\), less than one "
                                        r"length-32 sample"):
        build_splits(str(prefix), tok, 32, "96,2,2", 1, (8, 2, 2))
    train, valid, test = build_splits(str(prefix), tok, 32, "50,40,10", 1, (8, 2, 2))   # test: 1 document, unread
    assert len(train) >= 8 and len(valid) >= 2 and test is None
