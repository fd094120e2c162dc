"""How the supervisor starts its ranks: each under a keeper
(``elastic/rank/keeper.py``), forked from a pre-imported worker
(``elastic/rank/zygote.py``) that the supervisor starts once per run.

A relaunch used to spend most of its time in new processes importing torch and
Megatron-Core again (24.6 s of the demo's 32.4 s kill recovery, eight ranks importing
at once on two cores); a rank forked from the zygote finds them imported. The zygote
starts importing while the supervisor plans (the first launch's keepers wait for its
socket), dies with the supervisor, and lives in a directory of its own (a Unix
socket's path is limited to ~100 bytes, too short for some run directories).
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

from elastor_mcore.compat.process import parent_death_preexec
from elastor_mcore.elastic.job import RankCommand
from elastor_mcore.elastic.protocol import ZYGOTE_ENV
from elastor_mcore.elastic.torchrun import worker_env

KEEPER = "elastor_mcore.elastic.rank.keeper"
ZYGOTE = "elastor_mcore.elastic.rank.zygote"


def keeper_command(rank: RankCommand, in_place: bool) -> RankCommand:
    """``rank`` under a keeper; ``in_place``: a rank killed does not stop torchrun."""
    return RankCommand(KEEPER, [*(["--in-place"] if in_place else []), rank.module,
                                *rank.args])


@contextlib.contextmanager
def prestarted(enabled: bool, log_path: Path | None = None,
               env: dict[str, str] | None = None,
               imports: Sequence[str] = ()) -> Iterator[dict[str, str]]:
    """While inside, a zygote runs (if ``enabled``); yields the environment that points
    the keepers to it (empty when not enabled). ``env`` is added to the zygote's own
    environment: it shapes what the zygote's interpreter loads at its start (a
    ``sitecustomize`` on ``PYTHONPATH``), which its ranks inherit; each rank runs with
    its keeper's environment. ``imports``: the workload's own heavy modules, which the
    zygote imports too (``Workload.zygote_imports``)."""
    if not enabled:
        yield {}
        return
    directory = Path(tempfile.mkdtemp(prefix="elastor-zygote-"))
    socket_path = directory / "sock"
    out = open(log_path, "w") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(
        [sys.executable, "-m", ZYGOTE, "--socket", str(socket_path),
         *(f"--import={name}" for name in imports)], env=worker_env(env),
        stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        preexec_fn=parent_death_preexec(signal.SIGKILL))
    try:
        yield {ZYGOTE_ENV: str(socket_path)}
    finally:
        proc.kill()
        proc.wait()
        if log_path:
            out.close()
        shutil.rmtree(directory, ignore_errors=True)
