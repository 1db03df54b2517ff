"""The checkpoint publish protocol under interruption: every window of ``io.publish`` leaves the newest
complete checkpoint resolvable (issue 16, defect 6)."""
import json

import pytest

from setdiff_mega.checkpoint import io


class Killed(BaseException):
    """Stands for SIGKILL: nothing after the injection point runs (BaseException: no handler catches it)."""


def _save(save_dir, step, payload=b"w"):
    tmp = io.prepare_staging(save_dir, step)
    (tmp / "weights.bin").write_bytes(payload)
    return io.publish(tmp, {"step": step}, keep_last=2)


def _kill_at_latest(monkeypatch):
    real = io.write_text_atomic

    def write(path, text):
        if path.name == "latest":
            raise Killed
        real(path, text)
    monkeypatch.setattr(io, "write_text_atomic", write)


def test_kill_between_rename_and_latest_resolves_the_new_step(tmp_path, monkeypatch):
    _save(tmp_path, 100)
    _kill_at_latest(monkeypatch)
    with pytest.raises(Killed):
        _save(tmp_path, 200)
    root = io.checkpoints_root(tmp_path)
    assert (root / "latest").read_text().strip() == "step_0000100"      # the stale hint
    assert (root / "step_0000200" / "state.json").is_file()
    for p in (tmp_path, root):
        assert io.latest_checkpoint(p).name == "step_0000200"
    ck, state = io.resolve_checkpoint(tmp_path)
    assert state["step"] == 200 and (ck / "weights.bin").read_bytes() == b"w"


def test_kill_before_rename_keeps_the_previous_step(tmp_path, monkeypatch):
    _save(tmp_path, 100)
    monkeypatch.setattr(io.os, "replace", lambda *a: (_ for _ in ()).throw(Killed()))
    with pytest.raises(Killed):
        _save(tmp_path, 200)
    monkeypatch.undo()
    root = io.checkpoints_root(tmp_path)
    assert (root / "step_0000200.tmp").is_dir()                          # never read
    assert io.latest_checkpoint(tmp_path).name == "step_0000100"
    assert io.resolve_checkpoint(tmp_path)[1]["step"] == 100
    _save(tmp_path, 300)                                                  # the next save clears the leftover
    assert not (root / "step_0000200.tmp").exists()


def test_kill_while_resaving_the_only_step_finds_the_aside_copy(tmp_path, monkeypatch):
    tmp = io.prepare_staging(tmp_path, 100)
    (tmp / "weights.bin").write_bytes(b"old")
    io.publish(tmp, {"step": 100}, keep_last=1)
    real = io.os.replace

    def replace(src, dst):
        real(src, dst)
        if ".old-" in str(dst):      # the old copy moved aside; the new one is not renamed in yet
            raise Killed
    monkeypatch.setattr(io.os, "replace", replace)
    tmp = io.prepare_staging(tmp_path, 100)
    (tmp / "weights.bin").write_bytes(b"new")
    with pytest.raises(Killed):
        io.publish(tmp, {"step": 100}, keep_last=1)
    monkeypatch.undo()
    ck, state = io.resolve_checkpoint(tmp_path)
    assert ".old-" in ck.name and (ck / "weights.bin").read_bytes() == b"old" and state["step"] == 100


def test_latest_hint_is_not_needed(tmp_path):
    _save(tmp_path, 100)
    _save(tmp_path, 200)
    root = io.checkpoints_root(tmp_path)
    (root / "latest").unlink()
    assert io.latest_checkpoint(tmp_path).name == "step_0000200"
    (root / "latest").write_text("step_0000100\n")
    assert io.latest_checkpoint(tmp_path).name == "step_0000200"
    assert json.loads((root / "step_0000200" / "state.json").read_text())["step"] == 200
