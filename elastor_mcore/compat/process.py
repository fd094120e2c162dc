"""Tie a process's life to its parent's (Linux ``prctl(PR_SET_PDEATHSIG)``).

A job is a chain of processes: the launcher (``elastor train``/``launch``), torchrun,
the ranks. If a link is SIGKILLed, nothing runs that could stop the processes below
it, and they would go on training (and saving) unseen. With a parent-death signal
the kernel sends that signal to the child the moment its parent dies. Elsewhere than
Linux this is a no-op (logged once).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies; exit at once
    if the parent is already gone (it may have died before the call)."""
    parent = os.getppid()
    if not sys.platform.startswith("linux"):
        log.info("no parent-death signal on %s; the process outlives a killed parent",
                 sys.platform)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(ctypes.get_errno()))
        return
    if os.getppid() != parent:
        os._exit(128 + int(sig))


def parent_death_preexec(sig: int = signal.SIGTERM):
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when the
    process that started it dies."""
    def preexec() -> None:
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    return preexec


def signal_rank(pid: int, sig: int) -> None:
    """Send ``sig`` to a rank that leads a session of its own (a fork of the zygote) and
    to its process group (its own children: a shell's or torchrun's stop reaches them
    too). A rank that has not called ``setsid`` yet gets it alone; one already gone,
    nothing."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def finish_as_python_does() -> None:
    """What Python does when a program ends, for a process that must then leave by
    ``os._exit`` (a fork of the pre-imported worker, inside that worker's call stack):
    threading's shutdown (its exit callbacks, which stop thread pools' workers, then a
    join of the non-daemon threads), the ``atexit`` handlers (multiprocessing's stops
    the process's own children), a flush. ``threading._shutdown`` is what the
    interpreter itself calls; there is no public equivalent."""
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
