"""Start torchrun worlds: the one way every CLI, tool and test launches ranks.

We never reimplement rendezvous: torchrun (``torch.distributed.run``) in standalone
mode picks a free port, starts ``nproc`` workers and tears them all down when one
fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Sequence


def torchrun_command(nproc: int, module: str, args: Sequence[str] = ()) -> list[str]:
    """``python -m torch.distributed.run --standalone ... -m module args``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "--module",
            module, *args]


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for workers: one BLAS thread each (the ranks share the cores)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    env.update(extra or {})
    return env


def run_torchrun(nproc: int, module: str, args: Sequence[str] = (), *,
                 timeout: float | None = None, capture: bool = False,
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a torchrun world to completion; ``timeout`` kills the whole world."""
    return subprocess.run(
        torchrun_command(nproc, module, args), env=worker_env(env), timeout=timeout,
        capture_output=capture, text=True, start_new_session=True)
