#!/usr/bin/env python
"""Speed-quality frontier of AR, MDLM, BD3LM and SetDLM at one model size and token budget.

    python tools/bench_frontier.py                               # default: tiny_cpu size, ~40-55 min on 2 cores
    python tools/bench_frontier.py --steps 5000 --base-config configs/owt_setdlm.yaml --out runs/frontier_owt
    python tools/bench_frontier.py --methods ar,setdlm:D=4,bd3lm:block_size=4 --taus 0.5,0.9

Trains (or reuses) one model per method, sweeps the sampler settings (tau; W for SetDLM) on the held-out
math problems, and writes frontier.csv, frontier.png (accuracy against tokens/s, one curve per method),
infill.csv (SetDLM / BD3LM with both sides of the gap vs AR with the left context) and summary.json
(SetDLM's tokens/s at BD3LM's best accuracy) into --out. Re-running reuses trained models.
"""
import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from setdiff_mega.cli import run_cli  # noqa: E402


def parse_methods(text: str) -> list[dict]:
    out = []
    for item in text.split(","):
        name, *kv = item.strip().split(":")
        m = {"objective": name}
        for pair in kv:
            k, v = pair.split("=")
            m[k] = int(v)
        out.append(m)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/frontier")
    p.add_argument("--base-config", default="configs/tiny_cpu.yaml")
    p.add_argument("--steps", type=int, default=None, help="training steps per model (default 500)")
    p.add_argument("--methods", default=None, help="e.g. ar,mdlm,bd3lm:block_size=4,setdlm:D=4")
    p.add_argument("--taus", default=None, help="comma-separated commit thresholds")
    p.add_argument("--limit", type=int, default=None, help="math problems per point (default 48)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="decoding budget per problem (default 96)")
    p.add_argument("--tasks", default="data/embedded/tasks")
    p.add_argument("overrides", nargs="*", help="dotted config overrides for every model (data.path=..., ...)")
    args = p.parse_args(argv)
    from tqdm import tqdm

    from setdiff_mega.eval import frontier as F

    fc = F.FrontierConfig(out_dir=args.out, base_config=args.base_config)
    fc.overrides = fc.overrides + list(args.overrides)
    if args.steps:
        fc.train_steps = args.steps
    if args.methods:
        fc.methods = parse_methods(args.methods)
    if args.taus:
        fc.taus = [float(t) for t in args.taus.split(",")]
    if args.limit:
        fc.limit = fc.infill_limit = args.limit
    if args.max_new_tokens:
        fc.max_new_tokens = args.max_new_tokens
    out = Path(fc.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    models = F.train_models(fc)
    n_points = sum(len(F.settings(m, fc.taus)) for m in fc.methods)
    bar = tqdm(total=n_points, desc="frontier", unit="point", file=sys.stderr)
    points = F.evaluate_points(fc, models, args.tasks, log=bar.write, progress=bar.update)
    bar.close()
    infill = F.infill_table(fc, models, args.tasks)
    F.write_csv(points, out / "frontier.csv")
    F.write_csv(infill, out / "infill.csv")
    F.plot(points, out / "frontier.png", f"{fc.train_steps} steps per model, {fc.limit} problems")
    summary = {"summary": F.summarise(points), "infill": infill, "wall_s": time.perf_counter() - t0,
               "train_steps": fc.train_steps, "methods": fc.methods, "taus": fc.taus}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print("infilling (exact match / ROUGE-L):")
    for r in infill:
        print(f"  {r['method']:<16} {r['context']:<11} EM {r['exact_match']:.3f}  ROUGE-L {r['rouge_l']:.3f}  "
              f"{r['tokens_per_s']:.0f} tok/s")
    for metric, e in summary["summary"].items():
        b, s = e["bd3lm_best"], e["setdlm_fastest_at_least_as_accurate"]
        line = f"{metric}: BD3LM best {b[metric]:.3f} ({b['method']}, tau {b['tau']}, {b['tokens_per_s']:.0f} tok/s)"
        line += (f"; SetDLM at >= that: {s['tokens_per_s']:.0f} tok/s ({s['method']}, W {s['window']}, tau {s['tau']}; "
                 f"{e['speedup']:.2f}x)" if s else "; no SetDLM setting reaches it")
        print(line)
    print(f"wrote {out / 'frontier.csv'}, {out / 'frontier.png'}, {out / 'infill.csv'}, {out / 'summary.json'} "
          f"in {summary['wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
