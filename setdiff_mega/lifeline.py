"""Helper processes that must not outlive the process that started them (stdlib only, so a spawned
helper that runs :func:`tie_to_parent` first imports nothing heavy).

``tie_to_parent(parent, ignore)``: ignore the given signals, ask the kernel to SIGKILL this process
when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``), and, on every platform and for the race
where the parent died before the ``prctl``, poll ``os.getppid()`` once a second and exit when it is no
longer ``parent``.
"""
from __future__ import annotations

import os
import signal
import threading
import time

PR_SET_PDEATHSIG = 1


def tie_to_parent(parent: int, ignore: tuple = (signal.SIGTERM, signal.SIGUSR1)) -> None:
    for s in ignore:
        signal.signal(s, signal.SIG_IGN)
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


__all__ = ["tie_to_parent"]
