"""Leftovers of a killed run (setdiff_mega/staging.py): staging directories name their owner; a later run writing
the same output removes those whose owner is provably dead on this host (kill -9 leaves them behind) and leaves
a live run's, another host's and unrecorded ones alone, saying so."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import psutil

from setdiff_mega.outputs import staged_dir
from setdiff_mega.staging import OWNER, make_staging, owner_state, owner_tag, sweep_leftovers


def _killed() -> tuple[int, float]:
    """(pid, start time) of a process that was killed with SIGKILL (its pid no longer runs)."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    started = psutil.Process(p.pid).create_time()
    p.send_signal(signal.SIGKILL)
    p.wait()
    return p.pid, started


def _dead_owner(d):
    """``d`` owned by a process that was killed with SIGKILL."""
    pid, started = _killed()
    (d / OWNER).write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "started": started}))


def test_owner_states(tmp_path):
    mine = make_staging(tmp_path, ".x.staging-")
    assert owner_state(mine)[0] == "alive" and oct(mine.stat().st_mode & 0o777) != oct(0o700)
    dead = make_staging(tmp_path, ".x.staging-")
    _dead_owner(dead)
    assert owner_state(dead)[0] == "dead"
    reused = make_staging(tmp_path, ".x.staging-")        # a pid now running, but since another start time
    (reused / OWNER).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": 1.0}))
    assert owner_state(reused)[0] == "dead"
    far = make_staging(tmp_path, ".x.staging-")
    (far / OWNER).write_text(json.dumps({"host": "elsewhere-node", "pid": 1, "started": 1.0}))
    assert owner_state(far) == ("unknown", "pid 1 on elsewhere-node (another host)")
    bare = tmp_path / ".x.staging-old"
    bare.mkdir()
    assert owner_state(bare)[0] == "unknown"
    # killed between its mkdir and its record: the owner named in the directory's name decides
    host = owner_tag().split("-")[0]
    early = tmp_path / f".x.staging-{owner_tag()}-early"
    pid, started = _killed()
    early_dead = tmp_path / f".x.staging-{host}-{pid}-{round(started * 100)}-early"
    early_far = tmp_path / f".x.staging-{int(host, 16) ^ 1:08x}-1-1-early"
    for d in (early, early_dead, early_far):
        d.mkdir()
    assert [owner_state(d)[0] for d in (early, early_dead, early_far)] == ["alive", "dead", "unknown"]
    lines = []
    removed, kept = sweep_leftovers(tmp_path, (".x.staging-",), lines.append)
    assert set(removed) == {dead, reused, early_dead} and set(kept) == {mine, far, bare, early, early_far}
    assert all(d.exists() for d in kept) and not any(d.exists() for d in removed)
    assert sum(m.startswith("removed") for m in lines) == 3 and sum(m.startswith("left") for m in lines) == 5


def test_a_later_tool_run_removes_a_killed_runs_staging_and_keeps_a_live_ones(tmp_path):
    out = tmp_path / "export"
    leftover = make_staging(tmp_path, ".export.staging-")
    (leftover / "half_written.bin").write_bytes(b"\0" * 100)
    _dead_owner(leftover)
    live = make_staging(tmp_path, ".export.staging-")        # this process: a run still going
    other = make_staging(tmp_path, ".other.staging-")         # another output's: not ours to look at
    _dead_owner(other)
    with staged_dir(out, "test") as tmp:
        (tmp / "weights.bin").write_bytes(b"1")
    assert (out / "weights.bin").read_bytes() == b"1" and not (out / OWNER).exists()
    assert not leftover.exists() and live.exists() and other.exists()


def test_preprocessing_after_a_kill_9_removes_the_dead_runs_staging(tmp_path, two_tokenizers):
    """A preprocessing run killed with SIGKILL (as soon as its staging directory exists: before or after the owner
    record inside it was written, its name names the owner) leaves ``<out>.tmp-<owner tag>-0``; the next run of the
    same output removes it (its owner is dead) and says so."""
    from .conftest import ROOT

    tok = two_tokenizers[0] / "tokenizer.json"
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " + "word " * 200}) + "\n" for i in range(4000)))
    prefix = tmp_path / "data" / "corpus"
    args = [sys.executable, "tools/preprocess_data.py", "--input", str(corpus), "--output-prefix", str(prefix),
            "--tokenizer", str(tok), "--workers", "1"]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    p = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(prefix.parent.glob("corpus.tmp-*")):
        assert p.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
        time.sleep(0.01)
    p.send_signal(signal.SIGKILL)
    p.wait()
    left = list(prefix.parent.glob("corpus.tmp-*"))
    assert left and owner_state(left[0])[0] == "dead"
    r = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not any(d.exists() for d in left) and "left by an interrupted run" in r.stderr
    assert not list(prefix.parent.glob("corpus.tmp-*")) and prefix.with_suffix(".bin").exists()


def test_a_killed_writers_temporary_file_is_removed_by_the_next_write(tmp_path):
    """write_file_atomic's temporary file names its owner; one left by a process killed with SIGKILL while
    writing goes at the next write of the same file, a live writer's stays."""
    from setdiff_mega.outputs import write_file_atomic

    code = ("import os, signal, sys, tempfile; sys.path.insert(0, sys.argv[2]);"
            "from setdiff_mega.staging import file_prefix;"
            "fd, p = tempfile.mkstemp(prefix=file_prefix('report.json'), suffix='.tmp', dir=sys.argv[1]);"
            "os.write(fd, b'half'); os.kill(os.getpid(), signal.SIGKILL)")
    from .conftest import ROOT

    subprocess.run([sys.executable, "-c", code, str(tmp_path), str(ROOT)], check=False)
    left = list(tmp_path.glob(".report.json.owner-*.tmp"))
    assert len(left) == 1
    from setdiff_mega.staging import file_prefix
    live = tmp_path / (file_prefix("report.json") + "x.tmp")      # this process: still writing
    live.write_text("x")
    write_file_atomic(tmp_path / "report.json", "{}")
    assert (tmp_path / "report.json").read_text() == "{}"
    assert not left[0].exists() and live.exists()
