"""Fault tolerance's parts without a cluster (issue 42): the timeout policy, the heartbeat record and its
watchdog process (a hang detected within 2x the timeout, measured; a live or cleanly finished rank left
alone), the naming of the hung rank, the straggler statistics, and the restart supervisor's decisions
around a stand-in trainer."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from setdiff_mega.resilience.heartbeat import Timeouts
from setdiff_mega.resilience.straggler import StragglerMonitor
from setdiff_mega.resilience.supervisor import completed_steps, on_port, pretrain_args
from setdiff_mega.resilience.watchdog import culprit, hang_line

ROOT = Path(__file__).resolve().parents[2]


def test_timeouts_come_from_measured_durations_with_a_floor_and_an_override():
    t = Timeouts(fixed=0.0, factor=5.0, minimum=2.0, startup=30.0)
    assert t("step") == 30.0                      # not measured yet: the start-up allowance
    t.measured("step", 0.1)
    assert t("step") == 2.0                       # 5 x 0.1 s is under the floor
    t.measured("step", 1.0)
    t.measured("step", 0.5)
    assert t("step") == 5.0                       # the longest measured step, times the factor
    assert t("save") == 30.0
    fixed = Timeouts(fixed=7.0, factor=5.0, minimum=2.0, startup=30.0)
    assert fixed("step") == fixed("save") == 7.0 and fixed("startup") == 30.0


def _rec(rank, wall, inside="", collectives=10, state="S", step=5, phase="train step 5"):
    return {"rank": rank, "host": "h", "pid": 100 + rank, "wall": wall, "inside": inside, "collectives": collectives,
            "state": state, "step": step, "phase": phase, "timeout": 4.0}


def test_the_hung_rank_is_the_stopped_one_then_the_one_outside_the_collectives():
    waiting = [_rec(r, 10.0 + r, inside="all_reduce") for r in range(4)]
    # rank 2 is stopped although its beat is newer than rank 0's
    recs = [*waiting[:2], _rec(2, 12.0, state="T", inside="all_reduce"), waiting[3]]
    assert culprit(recs, recs[0])["rank"] == 2
    # rank 3 sleeps in its own work while the others wait for it
    recs = [*waiting[:3], _rec(3, 13.0)]
    assert culprit(recs, recs[0])["rank"] == 3
    # everybody inside: the one behind in collectives
    recs = [*waiting[:1], _rec(1, 11.0, inside="all_reduce", collectives=9), *waiting[2:]]
    assert culprit(recs, recs[0])["rank"] == 1
    line = hang_line(_rec(3, time.time() - 5), recs[0], 5.0)
    assert line.startswith("error: hang: rank 3 (host h, pid 103)") and "'train step 5'" in line
    assert "outside any collective" in line and "rank 0 waited 5.0s" in line and "\n" not in line


def test_the_straggler_warning_needs_the_same_rank_slow_at_patience_intervals_in_a_row():
    said = []
    m = StragglerMonitor(factor=1.5, patience=3, warn=said.append)
    assert m.judge([1.0, 1.0, 2.0, 1.0])["straggler/slowest_rank"] == 2
    m.judge([1.0, 1.0, 2.0, 1.0])
    assert not said
    m.judge([1.0, 3.0, 1.0, 1.0])                 # another rank: the count starts again
    m.judge([1.0, 3.0, 1.0, 1.0])
    assert not said
    stats = m.judge([1.0, 3.0, 1.0, 1.0])
    assert len(said) == 1 and "rank 1" in said[0] and "3.00x" in said[0]
    assert stats["straggler/max_over_median"] == 3.0 and stats["straggler/min_s"] == 1.0
    m.judge([1.0, 1.1, 1.0, 1.0])                 # within the factor: no suspect
    assert m.suspect is None


def test_restart_commands_move_the_rendezvous_port_and_find_the_trainer_arguments():
    cmd = ["torchrun", "--master_port", "29500", "pretrain/pretrain.py", "--config", "c.yaml", "train.lr=1"]
    assert pretrain_args(cmd) == ["--config", "c.yaml", "train.lr=1"]
    moved, env = on_port(cmd, {"MASTER_PORT": "29500"}, 2)
    assert moved[2] == "29502" and env["MASTER_PORT"] == "29502" and cmd[2] == "29500"
    mpi = ["mpiexec", "-genv", "MASTER_PORT", "1000", "python", "pretrain/pretrain.py"]
    assert on_port(mpi, {}, 1)[0][3] == "1001"
    assert on_port(cmd, {}, 0) == (cmd, {})
    assert completed_steps({"step": 7, "phase": "train step 7"}) == 6
    assert completed_steps({"step": 8, "phase": "save at step 8"}) == 8
    assert completed_steps({"step": -1, "phase": "startup"}) == -1


# -- the watchdog process ---------------------------------------------------------------------------------
RANK = textwrap.dedent("""
    import sys, time
    from types import SimpleNamespace
    from setdiff_mega.resilience.heartbeat import Heartbeat
    fc = SimpleNamespace(hang_timeout=float(sys.argv[2]), hang_factor=5.0, hang_min_timeout=1.0,
                         startup_timeout=30.0, heartbeat_poll=0.1)
    h = Heartbeat(fc, 0, sys.argv[1])
    mode = sys.argv[3]
    for step in range(1, 6):
        with h.phase("step", step, f"train step {step}"):
            time.sleep(0.05)
    if mode == "long":                            # steps for ~8 s; the watchdog's pid for the test to stop it
        print("watchdog", h.proc.pid, flush=True)
        for step in range(6, 166):
            with h.phase("step", step, f"train step {step}"):
                time.sleep(0.05)
    if mode == "hang":
        with h.phase("step", 6, "train step 6"):
            print("stalled", time.time(), flush=True)
            time.sleep(60)
    h.close()
    print("finished", flush=True)
""")


def _rank(tmp_path, mode, timeout=1.0):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-c", RANK, str(tmp_path), str(timeout), mode], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_hung_rank_is_killed_within_twice_its_timeout_and_named(tmp_path):
    # a 2 s timeout: the watchdog's 0.1 s polls and the kill get 2 s of slack on a loaded 2-core machine (1 s flaked)
    p = _rank(tmp_path, "hang", timeout=2.0)
    out, err = p.communicate(timeout=60)
    ended = time.time()
    assert p.returncode == -9, (out, err)
    stalled_at = float(out.split("stalled ")[1].split()[0])
    hang = json.loads((tmp_path / "heartbeats" / "hang.json").read_text())
    assert hang["rank"] == 0 and hang["phase"] == "train step 6" and hang["timeout"] == 2.0
    assert hang["detected_wall"] - stalled_at <= 2 * hang["timeout"], hang
    assert ended - stalled_at <= 2 * hang["timeout"] + 3.0      # + the killed process's teardown under load
    assert err.count("error: hang: rank 0") == 1, err


@pytest.mark.parametrize("alone", [False, True])
def test_a_paused_job_is_not_a_hang_but_a_rank_stopped_alone_is(tmp_path, alone):
    """SIGSTOP to the rank and its watchdog (a paused process group, a suspended VM) for 3x the 1 s timeout, then
    SIGCONT: the watchdog counts the stall from its own return, the rank beats again and finishes. The rank stopped
    alone, its watchdog running: named as stopped and killed, as before."""
    p = _rank(tmp_path, "long", timeout=1.0)
    watchdog = int(p.stdout.readline().split()[1])
    pids = [p.pid] if alone else [p.pid, watchdog]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    time.sleep(3.0)
    for pid in pids[::-1]:                        # the watchdog first: its rank, mid-step, beats only later
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.5)
    out, err = p.communicate(timeout=60)
    if alone:
        assert p.returncode == -9 and "its process is stopped" in err, (out, err)
    else:
        assert p.returncode == 0 and "finished" in out and "error: hang" not in err, (out, err)


@pytest.mark.parametrize("mode", ["finish"])
def test_a_rank_that_keeps_beating_and_finishes_is_left_alone(tmp_path, mode):
    p = _rank(tmp_path, mode, timeout=2.0)        # steps of 50 ms against a 2 s timeout (0.3 s flaked under load)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0 and "finished" in out, err
    assert not (tmp_path / "heartbeats" / "hang.json").exists()
    deadline, rec = time.time() + 15, {}
    while time.time() < deadline:                 # the watchdog process writes the record when it next looks
        try:
            rec = json.loads((tmp_path / "heartbeats" / "rank-00000.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            rec = {}
        if rec.get("phase") == "finished":
            break
        time.sleep(0.05)
    assert rec.get("phase") == "finished" and rec["timeout"] == 0.0, rec


# -- the supervisor around a stand-in trainer ---------------------------------------------------------------
FAKE = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    save = Path([a.split("=", 1)[1] for a in sys.argv if a.startswith("train.save_dir=")][0])
    save.mkdir(parents=True, exist_ok=True)
    n = int(os.environ["SETDIFF_RESTART_COUNT"])
    with open(save / "calls.jsonl", "a") as f:
        f.write(json.dumps({"attempt": n, "argv": sys.argv[1:], "port": os.environ.get("MASTER_PORT")}) + "\\n")
    if os.environ.get("FAKE_BEAT"):             # a heartbeat as a rank's watchdog publishes it: step 10(n + 1)
        (save / "heartbeats").mkdir(exist_ok=True)
        (save / "heartbeats" / "rank-00000.json").write_text(json.dumps({
            "rank": 0, "host": "h", "pid": os.getpid(), "attempt": n, "started": time.time(), "step": 10 * (n + 1),
            "phase": f"train step {10 * (n + 1)}", "wall": time.time(), "timeout": 1.0}))
    plan = json.loads(Path(os.environ["FAKE_PLAN"]).read_text())
    sys.exit(plan[n] if n < len(plan) else 0)
""")


def _supervise(tmp_path, plan, max_restarts=3, beat=False):
    (tmp_path / "pretrain").mkdir(parents=True, exist_ok=True)
    (tmp_path / "pretrain" / "pretrain.py").write_text(FAKE)
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    save = tmp_path / "run"
    env = dict(os.environ, FAKE_PLAN=str(tmp_path / "plan.json"), MASTER_PORT="29700", PYTHONPATH=str(ROOT),
               FAKE_BEAT="1" if beat else "")
    r = subprocess.run([sys.executable, "-m", "setdiff_mega.supervise", "--max-restarts",
                        str(max_restarts), "--restart-delay", "0", "--", sys.executable,
                        str(tmp_path / "pretrain" / "pretrain.py"), "--config", str(ROOT / "configs/tiny_cpu.yaml"),
                        f"train.save_dir={save}"], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    calls = [json.loads(line) for line in (save / "calls.jsonl").read_text().splitlines()]
    return r, calls, save


def test_the_supervisor_restarts_with_resume_auto_on_a_new_port_until_the_job_succeeds(tmp_path):
    r, calls, save = _supervise(tmp_path, [1, 1, 0], max_restarts=3, beat=True)
    assert r.returncode == 0, r.stderr
    assert [c["attempt"] for c in calls] == [0, 1, 2]
    assert "train.resume=auto" not in calls[0]["argv"] and calls[1]["argv"][-1] == "train.resume=auto"
    assert [c["port"] for c in calls] == ["29700", "29701", "29702"]
    assert r.stderr.count("supervisor: restart") == 2 and "restart 1/3" in r.stderr
    records = [json.loads(line) for line in (save / "restarts.jsonl").read_text().splitlines()]
    assert [x["attempt"] for x in records] == [0, 1] and records[0]["exit_status"] == 1
    assert [x["failed_at_step"] for x in records] == [10, 20] and "during step 10" in records[0]["reason"]


def test_the_supervisor_stops_on_a_refusal_and_on_failures_that_repeat_at_one_step(tmp_path):
    r, calls, _ = _supervise(tmp_path / "a", [2], max_restarts=3)
    assert r.returncode == 2 and len(calls) == 1 and "not restarting" in r.stderr
    r, calls, _ = _supervise(tmp_path / "b", [1, 1, 1, 1], max_restarts=5)
    assert r.returncode == 1 and len(calls) == 2                # fault.max_same_step_failures = 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: supervisor: the last 2 attempts failed during set-up"), last
    r, calls, _ = _supervise(tmp_path / "c", [1, 1, 1], max_restarts=0)
    assert r.returncode == 1 and len(calls) == 1 and "restarts (--max-restarts) are used up" in r.stderr
