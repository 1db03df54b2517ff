"""Helper processes that must not outlive the process that started them (stdlib only, so a spawned
helper that runs :func:`tie_to_parent` first imports nothing heavy).

``tie_to_parent(parent, ignore)``: ignore the given signals, ask the kernel to SIGKILL this process
when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``), and, on every platform and for the race
where the parent died before the ``prctl``, poll ``os.getppid()`` once a second and exit when it is no
longer ``parent``.

``tie_forks_to_parent()``: the same for every process this process forks from now on (megatron-core's
checkpoint writers are ``fork`` children; a writer caught mid-save by a SIGKILL of the trainer would
otherwise hang at exit on a queue nobody reads, keeping the resource tracker's pipe open too). The
kernel's parent-death signal follows the *thread* that forked, so it is set only for forks from the
thread that called this (the main thread); every fork gets the ``getppid`` poll.
"""
from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

PR_SET_PDEATHSIG = 1


def tie_to_parent(parent: int, ignore: tuple = (signal.SIGTERM, signal.SIGUSR1), pdeathsig: bool = True) -> None:
    for s in ignore:
        signal.signal(s, signal.SIG_IGN)
    if pdeathsig:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


_TIED: list[bool] = []     # at-fork hooks cannot be removed and are inherited by forks: register once


def tie_forks_to_parent() -> None:
    if _TIED:
        return
    _TIED.append(True)
    forking_thread, parent = threading.get_ident(), [0]

    def before():
        parent[0] = os.getpid()

    def child():
        tie_to_parent(parent[0], ignore=(), pdeathsig=threading.get_ident() == forking_thread)
    os.register_at_fork(before=before, after_in_child=child)


__all__ = ["tie_to_parent", "tie_forks_to_parent"]
