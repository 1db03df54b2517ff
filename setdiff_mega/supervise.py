"""The restart supervisor's entry point (``launch.sh --max-restarts N``; :mod:`setdiff_mega.resilience.supervisor`
has the logic): run a launcher command that starts ``pretrain/pretrain.py`` and restart it after a failure.

    python -m setdiff_mega.supervise --max-restarts N [--node-rank R] -- torchrun ... pretrain/pretrain.py ARGS
"""
import argparse
import os
import sys

from setdiff_mega.cli import run_cli
from setdiff_mega.config import load_config
from setdiff_mega.resilience.supervisor import Supervisor, pretrain_args
from setdiff_mega.train import parser


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-restarts", type=int, required=True)
    p.add_argument("--node-rank", type=int, default=int(os.environ.get("NODE_RANK", "0") or 0))
    p.add_argument("--restart-delay", type=float, default=1.0, help="seconds between a failure and its restart")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if a.max_restarts < 0 or not cmd or pretrain_args(cmd) is None:
        p.error("--max-restarts N >= 0 and a launcher command that runs pretrain/pretrain.py")
    args = parser().parse_args(pretrain_args(cmd))
    cfg = load_config(args.config, args.overrides)        # the run's save_dir and fault.*, as the trainer reads them
    return Supervisor(cmd, cfg, a.max_restarts, a.node_rank, a.restart_delay).run()


if __name__ == "__main__":
    sys.exit(run_cli(main))
