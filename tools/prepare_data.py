#!/usr/bin/env python
"""Build a tokenizer and a Megatron-format indexed dataset (.bin/.idx + manifest).

    python tools/prepare_data.py --embedded --out data/embedded          # the built-in corpus
    python tools/prepare_data.py --natural --out data/natural --vocab-size 2048    # installed Python sources
    python tools/prepare_data.py --input a.jsonl b.txt --json-key text --out data/mine [--tokenizer tok.json]
    python tools/prepare_data.py --task sudoku9 --knob givens=30 --out data/planning/sudoku9_g30   # generated task
    python tools/prepare_data.py --task arithmetic --knob steps=3 --format chat --tokenizer run/tokenizer.json \
        --out data/ft/arithmetic_s3        # chat records rendered with that tokenizer's chat template

--task (setdiff_mega/tasks, docs/tasks.md): train / dev / test splits held out by computation (checked: no dev or
test computation, answer or solution in the training records), {train,dev,test}.jsonl, tokenizer.json (the
character vocabulary unless --tokenizer), the train split as supervised data (corpus.*: data.format=sft) and
task.json (the layout: where the answer starts, the document length for data.seq_length).

Idempotent: with --skip-existing an output whose manifest exists is left alone (for --embedded: when its
embedded.json records the current generator version and every count given on the command line; for --natural:
when natural.json records the same documents; for --task: when task.json records the same spec), and an older
corpus this tool wrote there is rebuilt. Without it, an existing output of this tool needs --overwrite; a
non-empty directory this tool did not write, or one that holds an input, is never written.
"""
import argparse
import json
import sys
from pathlib import Path

from setdiff_mega import tasks
from setdiff_mega.cli import run_cli
from setdiff_mega.data.indexed import check_dataset, read_manifest
from setdiff_mega.data.natural import Source, default_sources, natural_documents, natural_is_current
from setdiff_mega.data.prepare import (
    TASK_RECORD,
    embedded_is_current,
    prepare,
    prepare_from_files,
    prepare_task,
    task_is_current,
    task_spec,
)
from setdiff_mega.outputs import check_output_dir, marked_by, write_marker


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--embedded", action="store_true",
                     help="generate the embedded corpus (math, stories, arithmetic, quests)")
    src.add_argument("--natural", action="store_true", help="the Python sources installed here: the standard "
                     "library and the project's pinned packages (setdiff_mega/data/natural.py)")
    src.add_argument("--input", nargs="+", help=".jsonl or plain-text files (blank-line separated documents)")
    src.add_argument("--task", help="a generated task: " + ", ".join(tasks.names()))
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--json-key", default="text")
    p.add_argument("--tokenizer", default=None, help="existing tokenizer.json (default: train a new BPE; "
                   "--task: the character vocabulary)")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--num-math", type=int, default=None, help="math problems (default 12000)")
    p.add_argument("--num-stories", type=int, default=None, help="stories (default 12000)")
    p.add_argument("--num-arith", type=int, default=None, help="arithmetic problems (default: --num-math)")
    p.add_argument("--num-quests", type=int, default=None, help="quest stories (default: 2/3 of --num-stories)")
    p.add_argument("--heldout", type=int, default=None, help="held-out task documents per task (default 128)")
    p.add_argument("--seed", type=int, default=None, help="corpus seed (default 0)")
    p.add_argument("--natural-mb", type=float, default=40.0, help="--natural: megabytes of text kept (after "
                   "deduplication and a shuffle with --seed)")
    p.add_argument("--natural-root", action="append", default=None, metavar="DIR",
                   help="--natural: read these directories instead of the default sources (repeatable)")
    p.add_argument("--knob", action="append", default=None, metavar="NAME=N", help="--task: a difficulty setting "
                   "(repeatable; docs/tasks.md lists each task's knobs)")
    p.add_argument("--format", choices=tasks.FORMATS, default="grid", help="--task: grid (character tokens, "
                   "[BOS] puzzle [SEP] answer [EOS]) or chat (a user turn and the answer, for --tokenizer's template)")
    p.add_argument("--num-train", type=int, default=20000, help="--task: training problems")
    p.add_argument("--num-dev", type=int, default=512, help="--task: dev problems (for choosing settings)")
    p.add_argument("--num-test", type=int, default=512, help="--task: test problems (touched once, for reporting)")
    p.add_argument("--workers", type=int, default=2, help="--task: generator processes")
    p.add_argument("--skip-existing", action="store_true", help="do nothing if OUT/corpus is complete")
    p.add_argument("--overwrite", action="store_true", help="rebuild a corpus this tool wrote at OUT")
    args = p.parse_args(argv)
    out = Path(args.out)
    tool = "prepare_data"
    inputs = [*(args.input or []), *(args.natural_root or []), args.tokenizer]
    check_output_dir(out, inputs, flag="--out", tool=tool, overwrite=args.overwrite,
                     continues=args.skip_existing,
                     owned=lambda d: marked_by(tool)(d) or read_manifest(d / "corpus") is not None)
    counts = {"num_math": args.num_math, "num_stories": args.num_stories, "num_arith": args.num_arith,
              "num_quests": args.num_quests, "seed": args.seed, "heldout": args.heldout}
    given = {k: v for k, v in counts.items() if v is not None}
    if args.task:
        return task_main(args, out, tool)
    natural = natural_corpus(args) if args.natural else None
    if args.skip_existing and read_manifest(out / "corpus") is not None and (out / "tokenizer.json").is_file():
        current = embedded_is_current(out, given) if args.embedded else \
            natural_is_current(_read_json(out / "natural.json"), natural[1]) if natural else True
        if current:
            info = check_dataset(out / "corpus")
            print(f"{out / 'corpus'} exists ({info['num_documents']} documents, {info['num_tokens']} tokens); skipping")
            return 0
        record = out / ("embedded.json" if args.embedded else "natural.json")
        print(f"{out} holds an older corpus or one built with other options ({record}); rebuilding")
    out.mkdir(parents=True, exist_ok=True)
    write_marker(out, tool)                 # first: an interrupted run's directory is still this tool's
    kw = dict(tokenizer_path=args.tokenizer, vocab_size=args.vocab_size)
    if args.embedded:
        dflt = {"num_math": 12000, "num_stories": 12000, "seed": 0, "heldout": 128}
        prepare(out, None, **{**dflt, **given}, **kw)
    elif natural:
        prepare(out, natural[0], **kw)
        (out / "natural.json").write_text(json.dumps(natural[1], indent=1))
    else:
        prepare_from_files(out, args.input, args.json_key, **kw)
    return 0


def task_main(args, out: Path, tool: str) -> int:
    """--task: a generated task's splits and supervised data (setdiff_mega/data/prepare.py: prepare_task)."""
    if args.format == "chat" and not args.tokenizer:
        raise ValueError("--format chat renders with a model's tokenizer and chat template: pass --tokenizer")
    sizes = {"train": args.num_train, "dev": args.num_dev, "test": args.num_test}
    spec = task_spec(args.task, tasks.parse_knobs(args.knob), args.format, args.seed or 0, sizes,
                     str(Path(args.tokenizer).resolve()) if args.tokenizer else None)
    if args.skip_existing and read_manifest(out / "corpus") is not None and task_is_current(out, spec):
        print(f"{out} holds this task already ({TASK_RECORD}); skipping")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    write_marker(out, tool)
    rec = prepare_task(out, spec, workers=args.workers)
    if rec["layout"]:
        lay = rec["layout"]
        print(f"grid layout: {lay['document_tokens']} tokens per document ([BOS] {lay['prompt_chars']} [SEP] "
              f"{lay['answer_chars']} [EOS]), the answer from token {lay['answer_start']}: data.seq_length >= "
              f"{lay['document_tokens']}")
    return 0


def natural_corpus(args) -> tuple[list[str], dict]:
    """--natural: the documents and their provenance (setdiff_mega/data/natural.py)."""
    sources = default_sources() if not args.natural_root else \
        [Source(Path(r).name, Path(r), "local") for r in args.natural_root]
    for s in sources:
        if not s.root.is_dir():
            raise FileNotFoundError(f"--natural-root '{s.root}' is not a directory")
    return natural_documents(sources, max_mb=args.natural_mb, seed=args.seed or 0)


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


if __name__ == "__main__":
    sys.exit(run_cli(main))
