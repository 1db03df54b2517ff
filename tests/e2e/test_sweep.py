"""tools/sweep.py end to end on a tiny grid: runs, results CSV, re-invocation skips finished runs, emit mode,
collect with too few runs for a fit, and the plot."""
import csv
import json

import pytest
import yaml

from .conftest import ROOT, run_here


def _grid(tmp_path, data_dir, **extra):
    grid = {"name": "t", "out_dir": str(tmp_path / "sweep"), "base_config": "configs/tiny_cpu.yaml",
            "overrides": [f"data.path={data_dir / 'corpus'}", "data.seq_length=32", "train.eval_interval=0",
                          "train.eval_iters=1", "train.log_interval=1", "train.warmup_steps=1",
                          "logging.wandb=disabled", "logging.progress=false"],
            "objectives": ["ar"], "seeds": [0],
            "models": [{"num_layers": 1, "hidden_size": 16, "num_attention_heads": 2},
                       {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 2}],
            "tokens": [256], "global_batch_size": 4, "micro_batch_size": 2, "budget_flops": 1e12, **extra}
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(grid))
    return path


def test_sweep_runs_collects_and_skips_finished_runs(data_dir, tmp_path):
    grid = _grid(tmp_path, data_dir)
    r = run_here(["tools/sweep.py", str(grid), "--bootstrap", "5"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "2 run(s) trained, 0 already finished" in r.stdout
    out = tmp_path / "sweep"
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert len(rows) == 2 and {row["objective"] for row in rows} == {"ar"}
    assert all(int(row["D"]) == 2 * 4 * 32 and float(row["flops"]) > 0 for row in rows)   # 2 steps of 4 x 32
    assert int(rows[0]["N"]) < int(rows[1]["N"])
    fits = json.loads((out / "fit.json").read_text())
    assert "at least 5" in fits["ar"]["error"]
    assert (out / "scaling.png").stat().st_size > 1000
    summaries = sorted(out.glob("runs/*/summary.json"))
    stamps = [p.stat().st_mtime_ns for p in summaries]

    r = run_here(["tools/sweep.py", str(grid), "--bootstrap", "5"])              # idempotent
    assert r.returncode == 0 and "skipping 2 finished run(s)" in r.stderr + r.stdout
    assert "0 run(s) trained, 2 already finished" in r.stdout
    assert [p.stat().st_mtime_ns for p in summaries] == stamps

    r = run_here(["tools/sweep.py", str(_grid(tmp_path, data_dir, tokens=[256, 512])), "--mode", "emit"])
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [x for x in (out / "commands.sh").read_text().splitlines() if x and not x.startswith("#")]
    assert len(lines) == 2 and all(x.startswith("bash launch.sh --nproc-per-node 1 --max-restarts 2 -- --config ")
                                   for x in lines)
    cfg = yaml.safe_load(open(lines[0].split("--config ")[1].strip()))       # one resolved config per run
    assert cfg["train"]["train_steps"] == 4 and cfg["objective"]["name"] == "ar"
    assert "--array=0-1" in (out / "sweep.sbatch").read_text()


def test_isoflop_grid_gives_each_model_the_tokens_of_its_budget(data_dir, tmp_path):
    import sys

    sys.path.insert(0, str(ROOT))
    from setdiff_mega.eval import sweep

    grid = sweep.load_grid(_grid(tmp_path, data_dir, tokens=None, isoflop=[1e10]))
    runs = sweep.expand(grid)
    assert len(runs) == 2
    fpt = [sweep.flops_per_token(grid, r.model, "ar") for r in runs]
    for r, f in zip(runs, fpt):                   # the rounded-up step count covers the budget
        assert 1e10 <= r.tokens * f < 1e10 + 4 * 32 * f
    assert runs[0].tokens > runs[1].tokens        # the smaller model trains on more tokens


def test_objective_variants_and_extra_seeds_expand_into_their_own_runs(data_dir, tmp_path):
    """``objectives`` may carry objective fields (``{name: bd3lm, block_size: 4}``: labelled runs whose config has
    them); ``extra_seeds`` adds seeds at one point; a point that is not in the grid is refused in one line."""
    from setdiff_mega.eval import sweep

    objectives = ["ar", {"name": "bd3lm", "block_size": 4}, {"name": "setdlm", "D": 4}]
    grid = sweep.load_grid(_grid(tmp_path, data_dir, objectives=objectives, tokens=[256, 512],
                                 extra_seeds=[{"objective": "setdlm-D4", "model": 1, "budget": 0, "seeds": [1, 2]}]))
    runs = sweep.expand(grid)
    assert len(runs) == 3 * 2 * 2 + 2
    assert {r.objective for r in runs} == {"ar", "bd3lm-block_size4", "setdlm-D4"}
    bd = next(r for r in runs if r.objective == "bd3lm-block_size4")
    cfg = sweep.load_run_config(grid, bd.overrides)
    assert (cfg.objective.name, cfg.objective.block_size, bd.method) == ("bd3lm", 4, "bd3lm")
    seeded = [r for r in runs if r.objective == "setdlm-D4" and r.model == grid.models[1] and r.tokens == 256]
    assert sorted(r.seed for r in seeded) == [0, 1, 2] and len({r.name for r in runs}) == len(runs)
    with pytest.raises(sweep.SweepError, match="names no point of the grid"):
        sweep.load_grid(_grid(tmp_path, data_dir, objectives=objectives,
                              extra_seeds=[{"objective": "setdlm", "model": 0, "budget": 0, "seeds": [1]}]))


def test_the_held_out_run_is_predicted_before_it_trains_and_then_checked(data_dir, tmp_path):
    """A grid with a ``holdout`` point (finished runs faked by their summaries: no training): collect writes the
    prediction once the fit has 5 runs and lists the held-out run as to do; emit then includes it; its measured
    loss is checked against the interval; the prediction file is never rewritten."""
    import importlib.util

    from setdiff_mega.eval import sweep

    spec = importlib.util.spec_from_file_location("sweep_tool", ROOT / "tools" / "sweep.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    path = _grid(tmp_path, data_dir, tokens=[256, 512, 1024],
                 holdout={"model": {"num_layers": 3, "hidden_size": 48, "num_attention_heads": 2}, "tokens": 2048})
    grid = sweep.load_grid(path)
    runs, (held,) = sweep.expand(grid), sweep.holdout_runs(grid)
    assert held.name.startswith("holdout_ar_") and held.tokens == 2048

    def fake(run, loss):
        d = grid.run_dir(run)
        d.mkdir(parents=True, exist_ok=True)
        (d / "summary.json").write_text(json.dumps({"final_step": run.steps, "final_val_loss": loss,
                                                    "num_parameters": 1000}))
    for r in runs:
        fake(r, 3.0 + 20.0 / r.tokens ** 0.3 + r.model["hidden_size"] ** -0.5)
    assert tool.main([str(path), "--mode", "collect", "--bootstrap", "10"]) == 0
    out = tmp_path / "sweep"
    pred = json.loads((out / "holdout_prediction.json").read_text())
    p = pred["predictions"]["ar"]
    assert p["runs_fitted"] == 6 and p["ci"][0] <= p["ci"][1] and p["loss"] > 3.0
    assert json.loads((out / "holdout.json").read_text())["ar"]["measured"] is None
    assert tool.main([str(path), "--mode", "emit"]) == 0
    assert held.name in (out / "commands.sh").read_text()
    measured = (p["ci"][0] + p["ci"][1]) / 2
    fake(held, measured)
    before = (out / "holdout_prediction.json").read_text()
    assert tool.main([str(path), "--mode", "collect", "--bootstrap", "10"]) == 0
    assert (out / "holdout_prediction.json").read_text() == before
    got = json.loads((out / "holdout.json").read_text())["ar"]
    assert got["measured"] == measured and got["inside"] is True and got["predicted"] == p["loss"]


@pytest.mark.slow      # three tiny trainings, one of them stopped and resumed: about a minute on 2 cores
def test_a_sigterm_stops_the_sweep_and_a_rerun_finishes_without_retraining(data_dir, tmp_path):
    """SIGTERM to the sweep while its second run trains: that run saves and stops, the next ones never start, the
    exit status is 143; the re-run skips the first (its summary untouched), resumes the second and trains the
    rest."""
    import os
    import signal
    import subprocess
    import sys
    import time

    path = _grid(tmp_path, data_dir, tokens=[256, 16384],
                 overrides=[f"data.path={data_dir / 'corpus'}", "data.seq_length=32", "train.eval_interval=0",
                            "train.eval_iters=1", "train.log_interval=1", "train.warmup_steps=1",
                            "train.save_interval=4", "logging.wandb=disabled", "logging.progress=false"],
                 models=[{"num_layers": 1, "hidden_size": 16, "num_attention_heads": 2},
                         {"num_layers": 1, "hidden_size": 24, "num_attention_heads": 2}])
    out = tmp_path / "sweep" / "runs"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    sweep = subprocess.Popen([sys.executable, "tools/sweep.py", str(path), "--bootstrap", "5"], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not list(out.glob("*T16384*/checkpoints/step_0000004/state.json")):  # the long run has saved once
        assert sweep.poll() is None and time.time() < deadline, sweep.communicate()
        time.sleep(0.1)
    first = next(out.glob("*T256*/summary.json"))
    stamp = first.stat().st_mtime_ns
    sweep.send_signal(signal.SIGTERM)
    _, err = sweep.communicate(timeout=120)
    assert sweep.returncode == 143, err[-2000:]
    long_run = next(out.glob("*T16384*"))
    assert json.loads((long_run / "summary.json").read_text())["stopped_by"] == "SIGTERM"
    assert len(list(out.glob("*/summary.json"))) == 2                 # the other model's runs never started
    r = run_here(["tools/sweep.py", str(path), "--bootstrap", "5"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "skipping 1 finished run(s)" in r.stderr + r.stdout and first.stat().st_mtime_ns == stamp
    assert "resumed from" in (long_run / "train.log").read_text()
    summaries = [json.loads(p.read_text()) for p in out.glob("*/summary.json")]
    assert len(summaries) == 4 and all(x.get("stopped_by") is None for x in summaries)


@pytest.mark.slow      # four tiny trainings, two of them under torchrun with 2 processes: about a minute
def test_the_emitted_cluster_commands_reproduce_the_local_sweep(data_dir, tmp_path):
    """The cluster path: a two-point grid emitted with 2 data-parallel processes per run, its commands.sh lines
    run as a Slurm array task would (launch.sh under torchrun, the supervisor's --max-restarts), then collected;
    the validation losses equal those of the same grid run locally in one process (micro batch 4 = 2 x 2)."""
    import os
    import socket
    import subprocess

    for k in ("local", "cluster"):
        (tmp_path / k).mkdir()
    common = dict(tokens=[512, 1024], global_batch_size=4,
                  models=[{"num_layers": 1, "hidden_size": 16, "num_attention_heads": 2}])
    local = _grid(tmp_path / "local", data_dir, micro_batch_size=4, **common)      # the same 4 validation samples
    r = run_here(["tools/sweep.py", str(local), "--bootstrap", "5"])
    assert r.returncode == 0, r.stderr[-2000:]
    cluster = _grid(tmp_path / "cluster", data_dir, micro_batch_size=2, data_parallel_size=2, **common)
    r = run_here(["tools/sweep.py", str(cluster), "--mode", "emit"])
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [x for x in (tmp_path / "cluster" / "sweep" / "commands.sh").read_text().splitlines()
             if x and not x.startswith("#")]
    assert len(lines) == 2 and all("--nproc-per-node 2 --max-restarts 2" in x for x in lines)
    for line in lines:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1",
               "MASTER_PORT": str(port)}
        p = subprocess.run(["bash", "-c", line], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
    r = run_here(["tools/sweep.py", str(cluster), "--mode", "collect", "--bootstrap", "5"])
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {k: list(csv.DictReader(open(tmp_path / k / "sweep" / "results.csv"))) for k in ("local", "cluster")}
    assert [x["run"] for x in rows["local"]] == [x["run"] for x in rows["cluster"]] and len(rows["local"]) == 2
    for a, b in zip(rows["local"], rows["cluster"]):
        assert (a["N"], a["D"], a["flops"]) == (b["N"], b["D"], b["flops"])
        assert float(a["val_loss"]) == pytest.approx(float(b["val_loss"]), rel=1e-4)
