"""Start torchrun worlds: the one way every CLI, tool and test launches ranks.

We never reimplement rendezvous: torchrun (``torch.distributed.run``) in standalone
mode picks a free port, starts ``nproc`` workers and tears them all down when one
fails; for several nodes, each node runs torch's elastic agent with torch's c10d
rendezvous, less the wait for a lost node's keep-alives to expire (the
``elastor-c10d`` backend of ``compat.rendezvous``; ``elastic_agent_command``), which
does membership, restarts and scale-up.

Stopping is part of launching. Torchrun runs in a session of its own (so a
terminal's Ctrl-C, which goes to the launcher's foreground process group, reaches
only the launcher) and starts each worker in a session of its own; so the launcher
forwards SIGINT and SIGTERM to torchrun, which stops its workers, and every link of
the chain gets a parent-death signal (``compat.process``): if the launcher is
SIGKILLed, torchrun gets SIGTERM and stops the workers; if torchrun is SIGKILLed,
the workers get SIGKILL (the rank entry points in ``elastic.rank`` arm that).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from typing import Iterator, Sequence

from elastor_mcore.compat.process import parent_death_preexec
from elastor_mcore.config.launch import NodeSettings

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def torchrun_command(nproc: int, module: str, args: Sequence[str] = ()) -> list[str]:
    """``python -m torch.distributed.run --standalone ... -m module args``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "--module",
            module, *args]


AGENT_MODULE = "elastor_mcore.compat.rendezvous"
"""A node's elastic agent: ``torch.distributed.run`` with ``elastor-c10d`` registered."""
RDZV_BACKEND = "elastor-c10d"
MONITOR_INTERVAL_S = 0.5
"""How often a node's agent checks its workers (torch's default is 5 s)."""


def elastic_agent_command(nproc: int, nodes: NodeSettings, max_restarts: int, module: str,
                          args: Sequence[str] = ()) -> list[str]:
    """``python -m elastor_mcore.compat.rendezvous --nnodes MIN:MAX --rdzv-backend
    elastor-c10d ...`` (torchrun's arguments): one node's elastic agent for the job
    ``nodes`` describes (every node gets the same endpoint, id and node counts; the
    agent on the endpoint's host hosts the rendezvous store), starting ``nproc``
    workers at every rendezvous round."""
    command = [sys.executable, "-m", AGENT_MODULE, f"--nnodes={nodes.nnodes}",
               f"--nproc-per-node={nproc}", f"--rdzv-backend={RDZV_BACKEND}",
               f"--rdzv-endpoint={nodes.rdzv_endpoint}", f"--rdzv-id={nodes.rdzv_id}",
               f"--max-restarts={max_restarts}", f"--monitor-interval={MONITOR_INTERVAL_S}"]
    if nodes.rdzv_conf:
        command.append(f"--rdzv-conf={nodes.rdzv_conf}")
    return [*command, "--module", module, *args]


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for workers: one BLAS thread each (the ranks share the cores)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    env.update(extra or {})
    return env


def start_torchrun(command: list[str], *, env: dict[str, str] | None = None,
                   **popen_kwargs) -> subprocess.Popen:
    """Start a torchrun world (``torchrun_command``, or a node's
    ``elastic_agent_command``) in its own session; it gets SIGTERM if we die."""
    return subprocess.Popen(
        command, env=worker_env(env), start_new_session=True,
        preexec_fn=parent_death_preexec(signal.SIGTERM), **popen_kwargs)


@contextlib.contextmanager
def forwarding_stop_signals(proc: subprocess.Popen) -> Iterator[list[int]]:
    """While inside, SIGINT/SIGTERM sent to this process go to ``proc``'s process
    group (torchrun stops its workers on either); yields the signals received, in
    order. Only the main thread can install handlers: elsewhere nothing is forwarded."""
    received: list[int] = []

    def forward(signum, _frame) -> None:
        received.append(signum)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signum)

    try:
        previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    except ValueError:  # not the main thread
        previous = {}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun's process group; its workers follow by their parent-death
    signal."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_torchrun(nproc: int, module: str, args: Sequence[str] = (), *,
                 timeout: float | None = None, capture: bool = False,
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a torchrun world to completion; ``timeout`` kills the whole world.

    A SIGINT or SIGTERM to this process stops the world the same way and is reported
    as the return code a shell gives (128 + the signal: 130, 143).
    """
    pipe = subprocess.PIPE if capture else None
    proc = start_torchrun(torchrun_command(nproc, module, args), env=env, stdout=pipe,
                          stderr=pipe, text=True)
    with forwarding_stop_signals(proc) as received:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except BaseException:  # the timeout, or an error of ours: leave nothing behind
            kill_job(proc)
            raise
    code = 128 + received[0] if received else proc.returncode
    return subprocess.CompletedProcess(proc.args, code, stdout, stderr)
