"""Pretrain AR / MDLM / BD3LM / SetDLM from a YAML preset with dotted overrides: the package's training
entry point (``python -m setdiff_mega.train``, the ``setdiff-pretrain`` console script, and
``pretrain/pretrain.py``, its thin wrapper; the sweeps and the reproduction launch this module).

    python -m setdiff_mega.train --config configs/tiny_cpu.yaml [section.field=value ...]
    python pretrain/pretrain.py --config configs/tiny_cpu.yaml objective.name=ar train.train_steps=100

The trainer writes ``<train.save_dir>/summary.json`` (rank 0); it is printed as the last line. A run
stopped by Ctrl-C saves, then exits with status 130.
"""
import argparse
import json
import sys

from setdiff_mega.cli import run_cli
from setdiff_mega.config import load_config, to_dict


def parser() -> argparse.ArgumentParser:
    """The trainer's command line (also parsed by launch.sh's restart supervisor, for train.save_dir)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny_cpu.yaml", help="YAML preset (default: %(default)s)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4 objective.D=8")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None,
                   help=argparse.SUPPRESS)     # passed by the deepspeed launcher; LOCAL_RANK is read from env
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        print(json.dumps(to_dict(cfg), indent=2))
        return 0
    # gated: the training stack imports megatron-core and DeepSpeed's helpers (seconds); --help and
    # --print-config (scripts/demo.sh asks it for the save_dir) do not need them
    from setdiff_mega.parallel import is_main_process
    from setdiff_mega.training import train

    result = train(cfg)
    if is_main_process():                     # one summary per job (the trainer wrote summary.json)
        print(json.dumps(result.summary()))
    return 130 if result.stopped_by == "SIGINT" else 0    # Ctrl-C: saved, and the caller sees an interrupt


def cli() -> None:
    sys.exit(run_cli(main))


if __name__ == "__main__":
    cli()
