"""The last line of a run that Ctrl-C or SIGTERM stopped: what was saved last.

Exit codes follow the shell's convention for a signal, 128 + its number (130 for
SIGINT, 143 for SIGTERM), so scripts can tell a stopped run from a failed one.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Callable

from elastor_mcore.checkpoint.format import latest_step


def stop_exit_code(signum: int) -> int:
    return 128 + signum


def stopped_by(exit_code: int) -> int | None:
    """The stop signal an exit code reports, if it reports one."""
    signum = exit_code - 128
    return signum if signum in (signal.SIGINT, signal.SIGTERM) else None


def report_stop(prefix: str, signum: int, save_dir: str | os.PathLike | None,
                latest: Callable[[str | os.PathLike], int | None] = latest_step) -> int:
    """Print which signal stopped the run and the step a resume would load (``latest``
    of the checkpoint root: the trainer's, or a workload's own); return the exit
    code."""
    name = signal.Signals(signum).name
    if save_dir is None:
        saved = "nothing was saved (no --save)"
    else:
        step = latest(save_dir)
        saved = (f"no checkpoint was committed in {save_dir}" if step is None else
                 f"the last committed checkpoint is step {step} in {save_dir}")
    print(f"{prefix}: stopped by {name}; {saved}", file=sys.stderr, flush=True)
    return stop_exit_code(signum)
