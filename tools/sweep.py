#!/usr/bin/env python
"""Scaling-law sweeps: run a grid of trainings, collect the losses, fit L(N, D), plot the frontier.

    python tools/sweep.py configs/sweeps/tiny.yaml                  # run (skip finished, resume interrupted),
                                                                    # then collect + fit + plot
    python tools/sweep.py configs/sweeps/tiny.yaml --mode emit      # commands.sh + sweep.sbatch for a cluster
    python tools/sweep.py configs/sweeps/tiny.yaml --mode collect   # CSV + fit + PNG from finished runs
    python tools/sweep.py configs/sweeps/tiny.yaml --list           # the runs and whether they are done

The grid's out_dir is this sweep's own: a new directory, or one it wrote before (continued); a non-empty
directory of anything else, or one holding the grid's inputs, is refused. Outputs in the grid's out_dir:
results.csv, fit.json (per objective: E, A, B, alpha, beta with 90%
bootstrap intervals, FLOPs per parameter-token, compute-optimal N and D for budget_flops), scaling.png, and with
AR in the grid compare.json (each other objective's compute multiplier over AR at equal validation loss, with
its bootstrap interval). With a ``holdout`` point: holdout_prediction.json (the fit's loss there, written once,
before the held-out runs train; run mode then trains them, emit mode emits them once it exists) and
holdout.json (prediction against measurement).
"""
import argparse
import json
import math
import sys
from pathlib import Path

from setdiff_mega.cli import run_cli
from setdiff_mega.data.blend import parse_blend
from setdiff_mega.eval import sweep
from setdiff_mega.eval.sweep import load_run_config
from setdiff_mega.eval.sweep.holdout import check, write_prediction
from setdiff_mega.outputs import claim_output_dir, either, read_marker


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("grid", help="sweep grid YAML")
    p.add_argument("--mode", choices=("run", "emit", "collect"), default="run")
    p.add_argument("--list", action="store_true", help="list the runs and exit")
    p.add_argument("--bootstrap", type=int, default=200, help="bootstrap resamples for the intervals")
    args = p.parse_args(argv)

    grid = sweep.load_grid(args.grid)
    runs = sweep.expand(grid)
    out = Path(grid.out_dir)
    if not args.list:
        claim_out_dir(grid, args.grid)
    predicted = (out / "holdout_prediction.json").is_file()
    if args.list:
        for r in runs + sweep.holdout_runs(grid):
            print(f"{'done' if sweep.finished(grid, r) else 'todo'}  {r.name}  ({r.steps} steps, {r.tokens} tokens)")
        return 0
    if args.mode == "emit":          # the held-out runs once their prediction exists (made by --mode collect)
        cmds, sbatch = sweep.emit(grid, runs + (sweep.holdout_runs(grid) if predicted else []))
        print(f"wrote {cmds} and {sbatch}: sbatch {sbatch}")
        return 0
    if args.mode == "run":
        res = sweep.run_local(grid, runs)
        print(f"sweep {grid.name}: {res['ran']} run(s) trained, {res['skipped']} already finished"
              + (f", {len(res['failed'])} failed: {res['failed']}" if res["failed"] else ""))
        if res["interrupted"]:
            return 143
    rows = sweep.collect(grid, runs)
    if not rows:
        print("no finished runs to collect yet")
        return 1
    out.mkdir(parents=True, exist_ok=True)
    sweep.write_csv(rows, out / "results.csv")
    fits = sweep.fit_all(rows, grid.budget_flops, n_boot=args.bootstrap)
    (out / "fit.json").write_text(json.dumps(fits, indent=2))
    sweep.plot(rows, fits, out / "scaling.png", f"sweep {grid.name}")
    print(f"{len(rows)} runs -> {out / 'results.csv'}, {out / 'fit.json'}, {out / 'scaling.png'}")
    for obj, f in fits.items():
        if "error" in f:
            print(f"  {obj}: {f['error']}")
            continue
        ft, ci = f["fit"], f["ci90"]
        line = (f"  {obj}: L = {ft['E']:.3f} + {ft['A']:.3g}/N^{ft['alpha']:.3f} + {ft['B']:.3g}/D^{ft['beta']:.3f}"
                f"  (alpha 90% CI {ci['alpha'][0]:.2f}-{ci['alpha'][1]:.2f}, beta {ci['beta'][0]:.2f}-"
                f"{ci['beta'][1]:.2f})")
        if "optimal" in f:
            o = f["optimal"]
            line += (f"; at {f['budget_flops']:.1e} FLOPs: N_opt={o['N']:.3g}, D_opt={o['D']:.3g} "
                     f"({o['tokens_per_param']:.1f} tokens/param), loss {o['loss']:.3f}")
        print(line)
    report_multipliers(rows, args.bootstrap, out)
    pred = write_prediction(grid, rows, args.bootstrap)         # before the held-out runs train, never after
    if pred is not None:
        if args.mode == "run":
            held = sweep.run_local(grid, sweep.holdout_runs(grid))
            if held["interrupted"]:
                return 143
            res["failed"] += held["failed"]
        check(grid, pred)
    return 0 if args.mode != "run" or not res["failed"] else 1


def report_multipliers(rows: list[dict], n_boot: int, out: Path) -> None:
    """compare.json: each objective's compute multiplier over AR at equal validation loss, with its interval
    (setdiff_mega/eval/sweep/compare.py; an unreachable loss is null)."""
    mult = sweep.multipliers(rows, reference="ar", n_boot=n_boot)
    if not mult:
        return
    finite = lambda x: x if not isinstance(x, float) or math.isfinite(x) else None       # noqa: E731
    clean = {o: [{k: (tuple(map(finite, v)) if k == "ci" else finite(v)) for k, v in m.items()} for m in ms]
             for o, ms in mult.items()}
    (out / "compare.json").write_text(json.dumps({"reference": "ar", "multipliers": clean}, indent=2))
    for obj, ms in mult.items():
        print(f"  {obj} / ar compute at equal loss: " + "; ".join(
            f"{m['multiplier']:.2f}x at loss {m['loss']:.3f} ({m['level']:.0%} CI {m['ci'][0]:.2f}-{m['ci'][1]:.2f})"
            for m in ms))


def claim_out_dir(grid, grid_file: str) -> None:
    """The grid's out_dir continues this sweep's earlier output, or is new; it never holds an input (the grid,
    its base config, its data) and is never a directory another tool or a person made."""
    data = parse_blend(load_run_config(grid).data.path)[0]
    inputs = [grid_file, grid.base_config, *(f"{p}{ext}" for p in data for ext in (".bin", ".idx"))]
    mine = lambda d: (read_marker(d) or {}).get("tool") == "sweep" and read_marker(d).get("grid") == grid.name
    legacy = lambda d: read_marker(d) is None and ((d / "runs").is_dir() or (d / "results.csv").is_file())
    claim_output_dir(grid.out_dir, inputs, flag=f"out_dir of grid '{grid.name}'", tool="sweep", continues=True,
                     owned=either(mine, legacy), grid=grid.name)


if __name__ == "__main__":
    sys.exit(run_cli(main))
