#!/usr/bin/env python
"""Draw how a checkpoint decodes a prompt: which token is written where, at which step (issue 40).

    python tools/visualize_decode.py --checkpoint runs/tiny_cpu --prompt "Question: 3 plus 4?" --out viz
    python tools/visualize_decode.py --checkpoint runs/ar --checkpoint runs/tiny_cpu --prompt "Once" --out viz
    python tools/visualize_decode.py --checkpoint runs/tiny_cpu --compare tau=1e6 --compare tau=0.9 \\
        --compare tau=0.5,window=8 --prompt "Once" --out viz         # one model at several settings
    python tools/visualize_decode.py --checkpoint runs/tiny_cpu --infill-prefix "A" --infill-suffix "B." --out viz
    python tools/visualize_decode.py --trace viz/traces.json --out viz2                 # redraw saved traces

Writes into --out (a new directory, or one this tool wrote, with --overwrite): ``decode.png`` (positions x
steps, each token a cell coloured by its commit step, with its text), ``decode.gif`` (the canvas filling in,
one frame per step), ``decode.html`` (the same animation, self-contained: it loads nothing), ``traces.json``
(the decoding traces: setdiff_mega/decoding/trace.py). Several --checkpoint (e.g. AR, BD3LM, MDLM and SetDLM
runs) or several --compare settings are drawn side by side on the same prompt. Decoding flags are
tools/generate.py's; --compare KEY=VALUE[,KEY=VALUE] overrides them per panel.
"""
import argparse
import dataclasses
import json
import sys
from pathlib import Path

from setdiff_mega.checkpoint import load_model
from setdiff_mega.cli import run_cli
from setdiff_mega.decoding.trace import DecodeTrace
from setdiff_mega.eval.decode_view import render_gif, render_grid, render_html
from setdiff_mega.inference import generate
from setdiff_mega.inference.engine import decoding_model
from setdiff_mega.inference.options import (
    add_chat_arguments,
    add_generation_arguments,
    chat_from_args,
    config_from_args,
)
from setdiff_mega.outputs import check_output_dir, claim_output_dir, write_file_atomic

TOOL = "visualize_decode"
FILES = ("decode.png", "decode.gif", "decode.html", "traces.json")


def parse_setting(text: str, cfg) -> tuple[str, object]:
    """'tau=0.5,window=8' -> (label, cfg with those fields); one line naming a bad key or value."""
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    over = {}
    for part in filter(None, text.split(",")):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in fields:
            raise ValueError(f"--compare '{text}': '{part}' is not KEY=VALUE with a decoding option as KEY "
                             f"(e.g. tau=0.5,window=8)")
        old = getattr(cfg, key)
        try:
            over[key] = type(old)(float(value)) if isinstance(old, (int, float)) and not isinstance(old, bool) \
                else (value.lower() in ("1", "true", "yes") if isinstance(old, bool) else value)
        except ValueError:
            raise ValueError(f"--compare '{text}': {key}={value!r} is not a {type(old).__name__}") from None
    return text, dataclasses.replace(cfg, **over).validate()


def request(args):
    if args.infill_prefix is not None or args.infill_suffix is not None:
        return {"prefix": args.infill_prefix or "", "suffix": args.infill_suffix or "", "span": args.span}
    if args.prompt is None:
        raise ValueError("give --prompt TEXT (or --infill-prefix / --infill-suffix), or --trace FILE")
    return args.prompt


def decode_panels(args) -> list[tuple[str, DecodeTrace]]:
    panels = []
    for ck in args.checkpoint:
        model, objective, tok, cfg = load_model(ck, weights=args.weights)
        model = decoding_model(model, cfg, tok, args.engine, args.decode_weights)
        L = cfg.data.seq_length
        base = dataclasses.replace(config_from_args(args, cfg.objective, L), record=True)
        settings = [parse_setting(s, base) for s in args.compare] or [(None, base)]
        for label, gc in settings:
            rec = generate(model, tok, objective, [request(args)], gc, context=L, chat=chat_from_args(tok, args))[0]
            name = f"{objective.name} ({Path(ck).name})" if len(args.checkpoint) > 1 or label is None else ""
            panels.append((", ".join(x for x in (name, label) if x), DecodeTrace(**rec["trace"])))
    return panels


def read_panels(paths: list[str]) -> list[tuple[str, DecodeTrace]]:
    panels = []
    for p in paths:
        try:
            data = json.loads(Path(p).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ValueError(f"--trace '{p}': cannot read a traces.json ({e})") from None
        items = data if isinstance(data, list) else [data]
        for i, item in enumerate(items):
            try:
                panels.append((item.get("label", f"{Path(p).name}[{i}]"),
                               DecodeTrace.from_json(json.dumps(item.get("trace", item)))))
            except (ValueError, TypeError, AttributeError) as e:
                raise ValueError(f"--trace '{p}' entry {i}: {e}") from None
    return panels


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", action="append", default=[], help="a checkpoint (repeatable: side by side)")
    p.add_argument("--trace", action="append", default=[], help="a traces.json written before (repeatable)")
    p.add_argument("--prompt")
    p.add_argument("--infill-prefix")
    p.add_argument("--infill-suffix")
    p.add_argument("--span", type=int, default=16, help="infill span length in tokens")
    p.add_argument("--compare", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                   help="a decoding setting to draw (repeatable: one panel each)")
    p.add_argument("--weights", choices=("ema", "raw"), default=None)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--overwrite", action="store_true", help="replace this tool's earlier output in --out")
    p.add_argument("--ms-per-step", type=int, default=400, help="animation speed")
    add_chat_arguments(p)
    add_generation_arguments(p)
    args = p.parse_args(argv)
    if bool(args.checkpoint) == bool(args.trace):
        raise ValueError("give --checkpoint (one or more) or --trace (one or more), not both")
    inputs = [*args.checkpoint, *args.trace]
    check_output_dir(args.out, inputs, flag="--out", tool=TOOL, overwrite=args.overwrite)   # before any work
    panels = decode_panels(args) if args.checkpoint else read_panels(args.trace)
    if not panels or not any(t.tokens for _, t in panels):
        raise ValueError("nothing was generated to draw (max_new_tokens, or an empty infill span?)")
    out = claim_output_dir(args.out, inputs, flag="--out", tool=TOOL, overwrite=args.overwrite)
    render_grid(panels, out / "decode.png")
    render_gif(panels, out / "decode.gif", args.ms_per_step)
    render_html(panels, out / "decode.html", title=f"Decoding: {panels[0][1].method}")
    write_file_atomic(out / "traces.json", json.dumps([{"label": lb, "trace": dataclasses.asdict(t)}
                                                       for lb, t in panels], indent=1))
    for label, t in panels:
        print(f"{label or t.method}: {len(t.tokens)} tokens in {t.num_steps} steps "
              f"({len(t.tokens) / max(t.num_steps, 1):.2f} tokens/step): {''.join(t.texts)!r}")
    print(f"wrote {', '.join(str(out / f) for f in FILES)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
