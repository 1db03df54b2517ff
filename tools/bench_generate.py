#!/usr/bin/env python
"""Decoding benchmark (not a test): tokens/s, NFE and tokens/step for every sampler on one model.

    python tools/bench_generate.py --checkpoint runs/tiny_cpu [--num-prompts 8] [--out-dir runs/bench_generate]

In one run, on the same model and prompts (the embedded held-out math questions, batch 1): SetDLM for
W in {1,2,4,8} x tau in {1e6, 0.9, 0.7, 0.5}, BD3LM for block sizes {2,4,8}, AR and MDLM; then the
SetDLM cache-on vs cache-off speed ratio when decoding --long-length positions (one token per step, no
EOS stop), on the checkpoint and on a larger random-weight model (--ratio-model); then the engines side
by side (native megatron-core model vs the plain-PyTorch model of the export format, interleaved, same
prompts and settings, identical tokens checked): SetDLM with the cache decoding --long-length positions,
SetDLM / AR / BD3LM on the math prompts, and for the long SetDLM case the split of a decode step into
the model forward and the samplers' own work (shared by both engines); then SetDLM's and BD3LM's decode
step on the same model and chunk (--same-chunk S: W = S, tau 0, S pending + S query rows every step;
same_chunk.json); then what recording the decoding trace costs (record off / on, interleaved;
trace_cost.json; --no-trace-cost skips it); then one decode forward against the machine's memory bandwidth
at the main job's shape and at GPT-2-small shape (--forward-shapes; random weights): ms per forward of the
plain forward in every --decode-weights format and of the megatron-core forward, interleaved, the bytes a
forward reads and the floor from a stream-copy benchmark in the same run, and a torch.profiler split of the
plain forward (by part, layer, operator) and of the megatron-core forward (forward.json, forward.png;
:mod:`setdiff_mega.inference.forward_bench`). ``--checkpoint`` may be a Hugging Face export: its own remote
code is then the plain engine. The grid decodes with --engine (default auto: plain when unsharded) and
--decode-weights. A checkpoint trained for self-speculation (model.shift_logits, objective.ar_weight > 0; issue 59)
first gets the speculative comparison (--speculative-only: only it): AR mode, SetDLM's threshold decoding at the best
of W = 4 x tau in {0.9, 0.7, 0.5} and speculative decoding at --speculative-windows, interleaved, tokens/s at batch 1
and 8, tokens per forward, acceptance lengths and draft acceptance by window position, and whether every prompt's
tokens equal AR mode's (speculative.json, speculative_acceptance.png). Writes bench_generate.csv,
cache_speedup.json, engine_speedup.json, same_chunk.json, trace_cost.json, forward.json, forward.png and
speed_vs_tau.png.
"""
import argparse
import csv
import json
import platform
import sys
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from setdiff_mega.checkpoint import hf, load_model
from setdiff_mega.cli import run_cli
from setdiff_mega.data.chat import ChatRenderer
from setdiff_mega.diffusion.setdlm import SETDLM
from setdiff_mega.hfmodel.generation_setdlm import DecodeModel
from setdiff_mega.hfmodel.linears import AUTO, CHOICES
from setdiff_mega.inference import GenerationConfig, benchmark, forward_bench
from setdiff_mega.inference.benchmark import default_grid, measure, plot_speed_vs_tau
from setdiff_mega.inference.engine import decoding_model, plain_model
from setdiff_mega.model import build_model
from setdiff_mega.outputs import claim_output_dir, either, holds_only, marked_by

REPORTS = (".csv", ".png", ".json", ".jsonl", ".log", ".txt")     # what an --out-dir of this tool holds


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default="runs/tiny_cpu")
    p.add_argument("--tasks", default="data/embedded/tasks/math.jsonl",
                   help="prompts (JSONL): records with 'question' (the held-out math questions, 'Question: ... "
                        "Answer:'), or with 'prompt' (a task split, e.g. tools/reproduce.py --convert's dev.jsonl; "
                        "'format': 'chat' renders it with the checkpoint's chat template, as its evaluation does)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--long-length", type=int, default=512, help="decoded positions for the cache on/off ratio")
    p.add_argument("--long-prompts", type=int, default=2)
    p.add_argument("--ratio-model", default="384,6,6",
                   help="hidden,layers,heads of a random-weight model for a second cache on/off ratio "
                        "(speed does not depend on the weights); 'none' to skip")
    p.add_argument("--context-length", type=int, default=None,
                   help="cache + chunk budget (default: the checkpoint's training length; larger: never crop)")
    p.add_argument("--out-dir", default="runs/bench_generate")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--engine", choices=("auto", "plain", "native"), default="auto", help="engine of the grid")
    p.add_argument("--engine-repeats", type=int, default=3, help="interleaved repeats of the engine comparison")
    p.add_argument("--no-engine-comparison", action="store_true")
    p.add_argument("--no-trace-cost", action="store_true", help="skip the decoding trace's cost (record off / on)")
    p.add_argument("--decode-weights", choices=CHOICES, default=AUTO, help="the grid's decode-weights format "
                   "(auto: fp32-packed on a CPU, fp32 on a GPU)")
    p.add_argument("--forward-shapes", default="main,gpt2",
                   help="shapes of the forward-vs-bandwidth measurement (main, gpt2; 'none' skips it)")
    p.add_argument("--forward-repeats", type=int, default=5, help="interleaved rounds of the forward measurement")
    p.add_argument("--forward-only", action="store_true", help="only the forward measurement (no checkpoint needed)")
    p.add_argument("--speculative-only", action="store_true",
                   help="only the self-speculation comparison (issue 59; a checkpoint trained with model.shift_logits "
                        "and objective.ar_weight > 0): AR mode, the best threshold setting and speculative decoding")
    p.add_argument("--speculative-windows", default="4,8", help="speculative windows W compared")
    p.add_argument("--speculative-repeats", type=int, default=3, help="interleaved repeats of the comparison")
    p.add_argument("--same-chunk", type=int, default=4, help="SetDLM's and BD3LM's decode step on the same model and "
                   "chunk (W = S = this, tau 0: this many pending + this many query rows every step; 0: skip)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = claim_output_dir(args.out_dir, [args.checkpoint, args.tasks], flag="--out-dir", tool="bench_generate",
                           continues=True, owned=either(marked_by("bench_generate"), holds_only(*REPORTS)))
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.forward_only:
        forward_report(args.forward_shapes.split(","), args.forward_repeats, out)
        return 0
    native, objective, tok, cfg = load_model(args.checkpoint)
    model = decoding_model(native, cfg, tok, args.engine, args.decode_weights)
    prompts = load_prompts(Path(args.tasks), args.num_prompts, tok)
    base = GenerationConfig(max_new_tokens=args.max_new_tokens, stop_at_eos=True,
                            context_length=args.context_length or cfg.data.seq_length)
    if args.speculative_only or getattr(model, "self_speculative", False):
        speculative_report(args, model, tok, objective, prompts, base, out)
        if args.speculative_only:
            return 0
    grid = default_grid(base)
    rows = []
    for method, gc in tqdm(grid, desc="settings", file=sys.stderr):
        r = measure(model, tok, method, prompts, gc)
        rows.append(r)
        tqdm.write(f"{method:7s} W={r.window:<2d} tau={r.tau:<8g} S={r.block_size:<3d} {r.tokens_per_s:8.1f} tok/s "
                   f"(+-{r.tokens_per_s_std:.1f})  NFE {r.nfe:6.1f}  {r.tokens_per_step:.2f} tok/step", file=sys.stderr)
    # cache on vs off at a long length: one token per step, fixed length (no EOS stop)
    long_cfg = replace(base, max_new_tokens=args.long_length - 8, window=4, tau=1e6, stop_at_eos=False)
    long_prompts = ["Question:"] * args.long_prompts
    on = measure(model, tok, "setdlm", long_prompts, long_cfg, warmup=0)
    off = measure(model, tok, "setdlm", long_prompts, replace(long_cfg, use_cache=False), warmup=0)
    rows += [on, off]
    speedup = {"length": args.long_length, "model_parameters": model.num_parameters(),
               "cache_on_tokens_per_s": on.tokens_per_s,
               "cache_off_tokens_per_s": off.tokens_per_s, "speedup": on.tokens_per_s / off.tokens_per_s,
               "setdlm_tokens_per_step_tau_0.9_W_4": next(r.tokens_per_step for r in rows if r.method == SETDLM.name
                                                           and r.window == 4 and r.tau == 0.9 and r.use_cache)}
    if args.ratio_model != "none":
        speedup["ratio_model"] = ratio_model_speedup(args.ratio_model, cfg, tok, long_prompts, long_cfg)
    with open(out / "bench_generate.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].as_dict()))
        w.writeheader()
        for r in rows:
            w.writerow(r.as_dict())
    (out / "cache_speedup.json").write_text(json.dumps(speedup, indent=2))
    if not args.no_engine_comparison:
        compare_engines(args, native, tok, cfg, prompts, base, long_cfg, out)
    if not args.no_trace_cost:
        trace_cost(args, model, tok, cfg, prompts, base, out)
    if args.same_chunk:
        same_chunk(args, model, tok, prompts, out)
    if args.forward_shapes != "none":
        forward_report(args.forward_shapes.split(","), args.forward_repeats, out)
    plot_speed_vs_tau(rows, out / "speed_vs_tau.png")
    print(json.dumps(speedup))
    print(f"wrote {out / 'bench_generate.csv'}, {out / 'cache_speedup.json'}, {out / 'speed_vs_tau.png'}")
    return 0


def load_prompts(path: Path, limit: int, tok) -> list:
    """The first ``limit`` prompts of a JSONL file (``--tasks``): 'question' records as 'Question: ... Answer:'
    strings, 'prompt' records as they are, or (``"format": "chat"``) as token ids rendered with the tokenizer's chat
    template and generation prompt (``{"input_ids": [...]}``, as the study's evaluation encodes them)."""
    if not path.is_file():
        raise FileNotFoundError(f"prompt file '{path}' does not exist; run tools/prepare_data.py --embedded first")
    chat, out = None, []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if len(out) == limit:
            break
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{path}:{n}: a prompt record is a JSON object with 'question' or 'prompt'")
        if "question" in rec and "prompt" not in rec:
            out.append(f"Question: {rec['question']}\nAnswer:")
        elif "prompt" in rec and rec.get("format") == "chat":
            chat = chat or ChatRenderer.of(tok)
            out.append({"input_ids": chat.prompt_ids(rec["prompt"])})
        elif "prompt" in rec:
            out.append(rec["prompt"])
        else:
            raise ValueError(f"{path}:{n}: a prompt record needs 'question' or 'prompt'")
    return out


def speculative_report(args, model, tok, objective, prompts, base, out: Path) -> None:
    """Issue 59: AR mode vs threshold decoding vs self-speculation (speculative.json, speculative_acceptance.png)."""
    windows = tuple(int(w) for w in args.speculative_windows.split(","))
    report = benchmark.speculative_comparison(model, tok, objective.name, prompts, base, windows=windows,
                                              repeats=args.speculative_repeats)
    report.update(checkpoint=str(args.checkpoint), machine=platform.platform(), threads=torch.get_num_threads())
    (out / "speculative.json").write_text(json.dumps(report, indent=2))
    benchmark.plot_acceptance(report, out / "speculative_acceptance.png")
    for n, r in report["settings"].items():
        print(f"{n:22s} batch-1 {r['tokens_per_s_batch1']:8.1f} tok/s  batch-8 {r.get('tokens_per_s_batch8', 0):8.1f} "
              f"tok/s  {r['tokens_per_forward']:.2f} tok/forward  equal to AR mode on "
              f"{r['prompts_equal_to_ar_mode']}/{report['prompts']} prompts", file=sys.stderr)
        if "draft_acceptance_by_position" in r:
            rates = " ".join(f"k={k}: {'-' if a['rate'] is None else format(a['rate'], '.2f')}"
                             for k, a in r["draft_acceptance_by_position"].items())
            print(f"{'':22s} draft acceptance by window position {rates}; forwards with drafts "
                  f"{r['forwards_with_drafts']:.2f}", file=sys.stderr)
    print(f"wrote {out / 'speculative.json'}, {out / 'speculative_acceptance.png'}", file=sys.stderr)


def same_chunk(args, model, tok, prompts, out: Path) -> None:
    """SetDLM's and BD3LM's decode step on the same model and chunk -> same_chunk.json."""
    same = benchmark.same_chunk(model, tok, prompts, args.same_chunk, args.max_new_tokens // args.same_chunk
                                * args.same_chunk, repeats=args.engine_repeats)
    same["setdlm_over_bd3lm"] = same["setdlm"]["step_ms"] / same["bd3lm"]["step_ms"]
    (out / "same_chunk.json").write_text(json.dumps(same, indent=2))
    for m in (n for n in same if n != "setdlm_over_bd3lm"):
        print(f"same chunk {m:6s} per step {same[m]['step_ms']:.3f} ms: forward {same[m]['forward_ms']:.3f} ms, "
              f"sampler {same[m]['sampler_ms']:.3f} ms (chunk {same[m]['chunk']})", file=sys.stderr)
    print(f"same chunk: SetDLM / BD3LM = {same['setdlm_over_bd3lm']:.2f}")


def forward_report(shapes: list, repeats: int, out: Path) -> None:
    """One decode forward per engine and format against the bandwidth floor, and its profile -> forward.json,
    forward.png (:mod:`setdiff_mega.inference.forward_bench`)."""
    unknown = sorted(set(shapes) - set(forward_bench.SHAPES))
    if unknown:
        raise ValueError(f"--forward-shapes: unknown {unknown}; choose among {', '.join(forward_bench.SHAPES)}")
    bw = forward_bench.stream_bandwidth()
    report = {"machine": platform.processor() or platform.machine(), "bandwidth_gb_s": bw, "shapes": []}
    for name in tqdm(shapes, desc="forward shapes", file=sys.stderr):
        shape = forward_bench.SHAPES[name]
        case = forward_bench.forward_case(shape, repeats=repeats, bandwidth=bw)
        native, cfg, tok = forward_bench.build_models(shape)
        chunk = forward_bench.Chunk(native, cfg.data.seq_length, shape.window, shape.vocab)
        case["profile"] = {f"plain-{f}": forward_bench.profile_forward(plain_model(native, cfg, tok, f), chunk)
                           for f in ("fp32", "fp32-packed", "bf16")}
        case["profile"]["megatron-core"] = forward_bench.profile_forward(native, chunk)
        report["shapes"].append(case)
        for r in case["rows"]:
            print(f"forward {name:5s} {r['engine']:18s} {r['ms_per_forward']:8.2f} ms  "
                  f"reads {r['bytes'] / 1e6:7.1f} MB  floor {r['floor_ms']:6.2f} ms  x{r['floor_ratio']:5.2f} of it  "
                  f"logits rel. err {r['logits_rel_err']:.1e}", file=sys.stderr)
    (out / "forward.json").write_text(json.dumps(report, indent=2))
    forward_bench.plot(report, out / "forward.png")


def ratio_model_speedup(spec: str, cfg, tok, prompts, long_cfg) -> dict:
    """Cache on / off on a random-weight native model of ``spec`` = hidden,layers,heads."""
    hidden, layers, heads = (int(x) for x in spec.split(","))
    mc = replace(cfg.model, hidden_size=hidden, num_layers=layers, num_attention_heads=heads,
                 ffn_hidden_size=None, zero_init_head=False, attention_backend="sdpa")
    torch.manual_seed(0)
    big = build_model(mc, tok.vocab_size).eval()
    on = measure(big, tok, "setdlm", prompts, long_cfg, warmup=0)
    off = measure(big, tok, "setdlm", prompts, replace(long_cfg, use_cache=False), warmup=0)
    return {"hidden": hidden, "layers": layers, "heads": heads, "parameters": big.num_parameters(),
            "cache_on_tokens_per_s": on.tokens_per_s, "cache_off_tokens_per_s": off.tokens_per_s,
            "speedup": on.tokens_per_s / off.tokens_per_s}


def trace_cost(args, model, tok, cfg, prompts, base, out: Path) -> None:
    """What recording the decoding trace costs (``GenerationConfig.record``, issue 40): the grid's engine on
    the math prompts, record off and on interleaved, identical tokens checked -> trace_cost.json."""
    cases = [("setdlm_math", "setdlm", prompts, replace(base, window=cfg.objective.D, tau=0.9)),
             ("ar_math", "ar", prompts, replace(base, tau=1e6))]
    rows = benchmark.compare_settings(model, tok, cases, {"off": {"record": False}, "on": {"record": True}},
                                      repeats=args.engine_repeats)
    for r in rows:
        print(f"trace {r['case']:14s} off {r['off_tokens_per_s']:7.1f} tok/s  on {r['on_tokens_per_s']:7.1f} tok/s  "
              f"on / off {r['speedup']:.3f}  identical tokens: {r['identical_tokens']}", file=sys.stderr)
    (out / "trace_cost.json").write_text(json.dumps({"repeats": args.engine_repeats, "cases": rows}, indent=2))


def compare_engines(args, native, tok, cfg, prompts, base, long_cfg, out: Path) -> None:
    """native vs plain engine, side by side (see the module docstring) -> engine_speedup.json."""
    if hf.is_hf_export(Path(args.checkpoint)):       # the export's own remote code
        plain = DecodeModel(AutoModelForCausalLM.from_pretrained(args.checkpoint, trust_remote_code=True).eval(),
                            cfg.data.seq_length)
    else:
        plain = plain_model(native, cfg, tok)
    D = cfg.objective.D
    cases = [("setdlm_cache_long", "setdlm", ["Question:"] * args.long_prompts, long_cfg),
             ("setdlm_math", "setdlm", prompts, replace(base, window=D, tau=0.9)),
             ("ar_math", "ar", prompts, replace(base, tau=1e6)),
             ("bd3lm_math", "bd3lm", prompts, replace(base, block_size=4, tau=0.9))]
    rows = benchmark.compare_engines({"native": native, "plain": plain}, tok, cases, repeats=args.engine_repeats)
    for r in rows:
        print(f"{r['case']:18s} native {r['native_tokens_per_s']:7.1f} tok/s  plain {r['plain_tokens_per_s']:7.1f} "
              f"tok/s  x{r['speedup']:.2f}  identical tokens: {r['identical_tokens']}", file=sys.stderr)
    split = benchmark.step_breakdown({"native": native, "plain": plain}, tok, "setdlm", cases[0][2], long_cfg,
                                     repeats=args.engine_repeats)
    for n, b in split.items():
        print(f"setdlm_cache_long  {n:6s} per step {b['step_ms']:.3f} ms: forward {b['forward_ms']:.3f} ms, "
              f"sampler {b['sampler_ms']:.3f} ms ({b['calls']} calls)", file=sys.stderr)
    report = {"checkpoint": str(args.checkpoint), "parameters": native.num_parameters(),
              "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
              "cases": rows, "step_breakdown": {"case": "setdlm_cache_long", **split}}
    (out / "engine_speedup.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({r["case"]: round(r["speedup"], 2) for r in rows}))


if __name__ == "__main__":
    sys.exit(run_cli(main))
