"""Shared CLI plumbing for the thin entry points in pretrain/ and tools/.

``run_cli(fn)`` sets the offline environment (no hub downloads, wandb offline unless asked), silences
library log lines that users cannot act on (:func:`quiet_libraries`), and turns the project's
user-facing errors (bad config, bad data, bad checkpoint, an output that would destroy something, failed
training) into one ``error: ...`` line and exit status 2 instead of a stack trace. SIGTERM (what ``timeout``, a
scheduler or a supervisor sends) is raised as :class:`Terminated` in the main thread when nothing else handles it,
so the tool unwinds like on Ctrl-C: a study's ``subprocess.run`` kills its training child instead of leaving it
running orphaned, ``finally`` blocks run, and the exit status is 143 (128 + SIGTERM). A handler installed later
(the trainer's save-and-stop, the server's shutdown) replaces this one.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading

from setdiff_mega import QUIET_LOGGERS
from setdiff_mega.errors import USER_ERRORS


def offline_env() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def quiet_libraries() -> None:
    """Library log lines about the installation, not the user's command (the package's QUIET_LOGGERS; the
    package import sets them too, before the tools import the libraries)."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def user_errors() -> tuple:
    """The exceptions whose message is the one line a user sees (setdiff_mega.errors, plus the standard ones
    the tools raise with a message of their own)."""
    return (*USER_ERRORS, FileNotFoundError, KeyError, ValueError)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is (module docstring)."""


def terminate_as_interrupt() -> None:
    """SIGTERM -> :class:`Terminated` in the main thread, unless a handler other than the default is set. A process
    forked from this one (a multiprocessing pool's worker, which its pool ends with SIGTERM) inherits the handler
    and dies of the signal as before: unwinding there would hang the pool."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return
    owner = os.getpid()

    def handler(signum, frame):
        if os.getpid() != owner:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise Terminated()
    signal.signal(signal.SIGTERM, handler)


def run_cli(fn, argv=None) -> int:
    offline_env()
    quiet_libraries()
    terminate_as_interrupt()
    errors = user_errors()
    try:
        return int(fn(argv) or 0)
    except errors as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"error: {msg}", file=sys.stderr)
        return 2
    except Terminated:
        print("terminated (SIGTERM)", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


__all__ = ["run_cli", "offline_env", "quiet_libraries", "terminate_as_interrupt", "Terminated"]
