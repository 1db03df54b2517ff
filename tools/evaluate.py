#!/usr/bin/env python
"""Evaluate a checkpoint (native or Hugging Face export): likelihood and the embedded tasks.

    python tools/evaluate.py --checkpoint runs/tiny_cpu                        # valid split + tasks
    python tools/evaluate.py --checkpoint runs/tiny_cpu --data data/embedded/corpus --orders 4
    python tools/evaluate.py --checkpoint exported/tiny --text held_out.jsonl --no-tasks --out eval.json
    # a parent's baseline: NLL on held-out text a pinned package ships, batch-1 greedy tokens/s from its prompts
    python tools/evaluate.py --checkpoint runs/smollm2_ar --heldout kjv --speed 8 --max-new-tokens 64 \
        --no-eos-stop --decode-weights fp32-packed --no-tasks --out runs/smollm2_ar/baseline.json
    # how far past the true prefix one SetDLM step is right (prompt / response records, e.g. a task's dev split)
    python tools/evaluate.py --checkpoint runs/my_setdlm --lookahead 4 --records dev.jsonl --limit 128 \
        --chat --no-tasks --no-likelihood

Likelihood (setdiff_mega/eval/likelihood.py): AR exact NLL; SetDLM the any-order bound for one sampled
order (``--orders K``: mean over K orders, and the tighter -log-mean-exp); MDLM / BD3LM the NELBO
(``--orders K`` draws of t). On ``--data PREFIX`` (an indexed dataset: its validation split, the
checkpoint's split and seed) or ``--text FILE`` (.txt: one document per line; .jsonl: a "text" field;
documents chunked to L like training data) or ``--heldout NAME`` (natural text a pinned package ships:
setdiff_mega/eval/heldout.py; ``--speed N`` adds batch-1 decoding of N prompts from it: tokens/s with the
decoding flags). Tasks (setdiff_mega/eval/tasks.py, docs/tasks.md): math and
arithmetic exact match, story and quest infilling (exact match, ROUGE-L, and the left-context-only
variant), with tokens/s and NFE,
decoded with the shared decoding flags (--tau, --window, --preset, ...: tools/generate.py --help). ``--chat``
(a model fine-tuned on conversations): the math tasks are asked as the paper's GSM8K user turn (its
step-by-step instruction + the question) rendered with the checkpoint's chat template, and scored on the
last \boxed{} (``--preset gsm8k`` stops there). ``--lookahead K --records FILE`` (setdiff_mega/eval/lookahead.py):
on the first ``--limit`` prompt / response records (as one chat turn with ``--chat``, as training data lays it out),
the accuracy of one decoding step's token at each offset k < K past the true prefix, its confidence, and the mean
run of leading right tokens (about what a rule that commits exactly the right ones would deliver per step).
Prints a one-line summary; ``--out`` writes everything as JSON.
"""
import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from setdiff_mega import package_files
from setdiff_mega.checkpoint import load_model
from setdiff_mega.cli import run_cli
from setdiff_mega.eval import heldout, likelihood, lookahead, tasks
from setdiff_mega.eval.likelihood import split_nll
from setdiff_mega.inference.engine import decoding_model, weights_format
from setdiff_mega.inference.options import (
    add_chat_arguments,
    add_generation_arguments,
    chat_from_args,
    config_from_args,
)
from setdiff_mega.outputs import check_output_file, write_file_atomic


def read_texts(path: str) -> list[str]:
    p = package_files.resolve(path)
    if not p.is_file():
        raise FileNotFoundError(f"text file '{p}' does not exist")
    lines = [(i, x) for i, x in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if x.strip()]
    out = []
    for i, x in lines:
        if p.suffix != ".jsonl":
            out.append(x)
            continue
        try:
            out.append(json.loads(x)["text"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{p}:{i}: expected a JSON object with a 'text' field") from None
    if not any(t.strip() for t in out if isinstance(t, str)):
        raise ValueError(f"text file '{p}' holds no documents: a likelihood over it would score nothing")
    return out


def _likelihood(model, objective, tok, cfg, texts, args) -> dict:
    """NLL per token of --heldout / --text documents, or of the checkpoint's validation split."""
    if not (args.heldout or args.text):
        return valid_split_nll(model, objective, tok, cfg, args)
    bar = tqdm(desc="likelihood", unit="seq", file=sys.stderr)
    res = likelihood.text_nll(model, objective, tok, texts, cfg.data.seq_length, args.orders, args.seed,
                              args.batch_size, progress=bar.update)
    bar.close()
    if args.heldout:
        res.update(heldout.describe(args.heldout), documents=len(texts))
    else:
        res["source"] = args.text
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--data", help="indexed dataset prefix (default: the checkpoint's data.path)")
    p.add_argument("--text", help="raw .txt / .jsonl documents instead of an indexed dataset (a path, or "
                   "pkg:PACKAGE/PATH: a file an installed package ships)")
    p.add_argument("--heldout", choices=sorted(heldout.TEXTS), help="held-out natural text a pinned package ships "
                   "instead of an indexed dataset (setdiff_mega/eval/heldout.py)")
    p.add_argument("--speed", type=int, default=0, metavar="N", help="with --heldout: batch-1 decoding of N prompts "
                   "from it (the decoding flags; one warm-up prompt first): tokens/s, NFE, tokens/step")
    p.add_argument("--max-sequences", type=int, default=256, help="validation sequences to score")
    p.add_argument("--orders", type=int, default=1, help="orders (SetDLM) or t draws (MDLM/BD3LM) per sequence")
    p.add_argument("--tasks", default="data/embedded/tasks", help="directory with math.jsonl / stories.jsonl")
    p.add_argument("--no-tasks", action="store_true")
    p.add_argument("--no-likelihood", action="store_true")
    p.add_argument("--limit", type=int, default=64, help="examples per task")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--out", help="write the full report here (JSON)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p.add_argument("--weights", choices=("ema", "raw"), default=None,
                   help="the EMA of a train.ema_decay run or the raw weights (default: the EMA when present)")
    p.add_argument("--lookahead", type=int, default=0, metavar="K",
                   help="teacher-forced window accuracy at offsets 0..K-1 on --records (a windowed or causal model)")
    p.add_argument("--records", help="with --lookahead: prompt / response JSONL records (the first --limit)")
    add_chat_arguments(p)
    add_generation_arguments(p, max_new_tokens=96)
    args = p.parse_args(argv)
    args.seed = 0 if args.seed is None else args.seed
    texts, task_rows = check_inputs(args)          # before any work: evaluations that would score nothing
    records, wheres = read_records(args.records, args.limit) if args.lookahead else (None, None)

    model, objective, tok, cfg = load_model(args.checkpoint, weights=args.weights)
    args.chat_renderer = chat_from_args(tok, args)
    L = cfg.data.seq_length
    report = {"checkpoint": str(args.checkpoint), "weights": model.weights_kind, "objective": objective.name,
              "seq_length": L}
    if not args.no_likelihood:
        report["likelihood"] = _likelihood(model, objective, tok, cfg, texts, args)
    if args.speed:
        decoder = decoding_model(model, cfg, tok, args.engine, args.decode_weights)
        gc = config_from_args(args, cfg.objective, L)
        report["speed"] = {**heldout.decode_speed(decoder, tok, objective, heldout.prompts(args.heldout, args.speed),
                                                  gc, L),
                           "decode_weights": weights_format(decoder), "engine": args.engine, "config": asdict(gc)}
    if not args.no_tasks:
        gc = config_from_args(args, cfg.objective, L)
        decoder = decoding_model(model, cfg, tok, args.engine, args.decode_weights)
        report.update(run_tasks(decoder, tok, objective, gc, L, args, task_rows))
    if args.lookahead:
        report["lookahead"] = run_lookahead(model, cfg, tok, objective, args, records, wheres)
    print(summary(report))
    if args.out:
        write_file_atomic(args.out, json.dumps(report, indent=2))
    return 0


def summary(report: dict) -> str:
    """The one-line summary of a report."""
    parts = [report["objective"]]
    if "likelihood" in report:
        lk = report["likelihood"]
        parts.append(f"NLL {lk['nll_per_token']:.4f}/token (ppl {lk['ppl']:.2f}, {lk['tokens']} tokens)")
    if "speed" in report:
        sp = report["speed"]
        parts.append(f"batch-1 {sp['tokens_per_s']:.1f} tok/s ({sp['requests']} prompts, {sp['tokens']} tokens, "
                     f"{sp['tokens_per_step']:.2f} tok/step)")
    if "math" in report:
        m, i = report["math"], report["infill"]
        parts.append(f"math acc {m['accuracy']:.3f} ({m['tokens_per_s']:.0f} tok/s, {m['tokens_per_step']:.2f} "
                     f"tok/step)")
        parts.append(f"infill EM {i['exact_match']:.3f} ROUGE-L {i['rouge_l']:.3f} (left-only ROUGE-L "
                     f"{report['infill_left_only']['rouge_l']:.3f})")
        if "arith" in report:
            parts.append(f"arith acc {report['arith']['accuracy']:.3f}")
        if "quest_infill" in report:
            q, ql = report["quest_infill"], report["quest_infill_left_only"]
            parts.append(f"quest infill EM {q['exact_match']:.3f} (left-only {ql['exact_match']:.3f})")
    if "lookahead" in report:
        la = report["lookahead"]
        parts.append("lookahead acc " + " ".join(f"{a:.3f}" for a in la["acc"]) + f", mean run {la['mean_run']:.2f}"
                     f" ({la['records']} records, {la['steps']} prefixes)")
    return " | ".join(parts)


def check_inputs(args) -> tuple:
    """(texts or None, task rows or None), refusing evaluations that would evaluate nothing."""
    if args.no_tasks and args.no_likelihood and not args.speed and not args.lookahead:
        raise ValueError("--no-tasks together with --no-likelihood leaves nothing to evaluate; drop one of them")
    if args.lookahead < 0 or bool(args.lookahead) != bool(args.records):
        raise ValueError("--lookahead K (K >= 1) and --records FILE go together: give both or neither")
    for name in ("max_sequences", "orders", "limit", "batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")
    if sum(bool(x) for x in (args.text, args.data, args.heldout)) > 1:
        raise ValueError("--text, --data and --heldout each name the likelihood's documents: give one of them")
    if args.speed and not args.heldout:
        raise ValueError("--speed N decodes prompts from the held-out text: give --heldout NAME")
    if args.speed < 0:
        raise ValueError(f"--speed must be >= 0 (got {args.speed})")
    if args.out:
        check_output_file(args.out, [args.checkpoint, args.text, args.data, args.tasks, args.records], flag="--out",
                          overwrite=args.overwrite)
    if args.heldout:
        if args.speed:
            heldout.prompts(args.heldout, args.speed)          # the count checked before any work
        return (heldout.documents(args.heldout) if not args.no_likelihood else None,
                None if args.no_tasks else load_task_rows(args.tasks, args.limit))
    texts = read_texts(args.text) if args.text and not args.no_likelihood else None
    return texts, None if args.no_tasks else load_task_rows(args.tasks, args.limit)


def load_task_rows(task_dir: str, limit: int) -> dict:
    """The embedded tasks present in ``task_dir`` (math and stories required; arithmetic and quests when
    their files exist: corpora of generator version >= 2)."""
    rows = {n: tasks.load_task(task_dir, n, limit) for n in ("math", "stories")}
    rows.update({n: tasks.load_task(task_dir, n, limit) for n in ("arith", "quests")
                 if (Path(task_dir) / f"{n}.jsonl").is_file()})
    return rows


def run_tasks(model, tok, objective, gc, L, args, rows: dict) -> dict:
    """The embedded tasks ``rows`` (:func:`load_task_rows`), decoded with ``gc``."""
    report = {}
    math_rows, story_rows = rows["math"], rows["stories"]
    newer = {n: rows[n] for n in ("arith", "quests") if n in rows}
    total = len(math_rows) + 2 * len(story_rows) + len(newer.get("arith", [])) + 2 * len(newer.get("quests", []))
    bar = tqdm(total=total, desc="tasks", unit="ex", file=sys.stderr)
    chat = args.chat_renderer
    report["math"] = tasks.math_accuracy(model, tok, objective, math_rows, gc, L, args.batch_size,
                                         progress=bar.update, chat=chat)
    if "arith" in newer:
        report["arith"] = tasks.math_accuracy(model, tok, objective, newer["arith"], gc, L, args.batch_size,
                                              progress=bar.update, chat=chat)
    for key, rows, task in (("infill", story_rows, "stories"), ("quest_infill", newer.get("quests"), "quests")):
        if rows is None:
            continue
        report[key] = tasks.story_infill(model, tok, objective, rows, gc, L, args.batch_size,
                                         progress=bar.update, task=task)
        report[key + "_left_only"] = tasks.story_infill(model, tok, objective, rows, gc, L, left_only=True,
                                                        progress=bar.update, task=task)
    bar.close()
    return report


def read_records(path: str, limit: int) -> tuple[list[dict], list[str]]:
    """The first ``limit`` prompt / response records of a JSONL file and their ``file:line`` (one clear message
    for a bad line)."""
    p = package_files.resolve(path)
    if not p.is_file():
        raise FileNotFoundError(f"records file '{p}' does not exist")
    out, wheres = [], []
    for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            ok = isinstance(r, dict) and isinstance(r.get("prompt"), str) and isinstance(r.get("response"), str)
        except json.JSONDecodeError:
            ok = False
        if not ok:
            raise ValueError(f"{p}:{i}: expected a JSON object with string 'prompt' and 'response' fields")
        out.append(r)
        wheres.append(f"{p}:{i}")
        if len(out) == limit:
            break
    if not out:
        raise ValueError(f"records file '{p}' holds no records: the lookahead would score nothing")
    return out, wheres


def run_lookahead(model, cfg, tok, objective, args, records: list[dict], wheres: list[str]) -> dict:
    """--lookahead K on --records (``wheres``: each record's ``file:line``), decoded with the flags' engine and
    weights (greedy, one step per prefix)."""
    lookahead.window_of(objective.name, args.lookahead)         # a block method: refused before decoding
    decoder = decoding_model(model, cfg, tok, args.engine, args.decode_weights)
    renderer = args.chat_renderer
    bar = tqdm(desc="lookahead", unit="prefix", file=sys.stderr)
    res = lookahead.measure(decoder, tok, objective, cfg, records, args.lookahead, args.batch_size, renderer,
                            progress=bar.update, wheres=wheres)
    bar.close()
    return {**asdict(res), "records_file": args.records, "chat_template": renderer is not None,
            "decode_weights": weights_format(decoder)}


def valid_split_nll(model, objective, tok, cfg, args) -> dict:
    bar = tqdm(total=args.max_sequences, desc="likelihood", unit="seq", file=sys.stderr)
    res = split_nll(model, objective, tok, cfg, args.data, args.max_sequences, args.orders, args.seed,
                    args.batch_size, progress=bar.update)
    bar.close()
    return res


if __name__ == "__main__":
    sys.exit(run_cli(main))
