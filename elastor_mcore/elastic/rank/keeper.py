"""The process torchrun starts for a rank that may recover in place:
``torchrun ... -m elastor_mcore.elastic.rank.keeper MODULE ARGS...``.

Torchrun stops every worker of a launch as soon as one exits non-zero. For the
survivors of a failure to recover in place, a rank that dies must not look like a
failed worker to torchrun, so the rank (``MODULE``, with its ``ARGS``) runs in a child
of this small process, which imports no torch and only waits:

- the child exits 0: so does the keeper;
- the child ends by a signal (a crash, ``SIGKILL``, killed as hung by the supervisor):
  the keeper exits 0, and torchrun keeps the other ranks; the supervisor sees the
  death by the heartbeat's pid and the survivors recover in place;
- the child exits non-zero (an error, or a recovery in place that failed): so does the
  keeper, torchrun stops the launch and the supervisor relaunches from the durable
  checkpoint.

Both are in torchrun's process group for the worker (a stop signal reaches both) and
the child dies with the keeper (``compat.process``).
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

from elastor_mcore.compat.process import die_with_parent


def run_child(module: str, args: list[str]) -> None:
    """In the child: run ``module`` as ``python -m module args`` would; never returns."""
    die_with_parent()
    sys.argv = [module, *args]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_code(status: int) -> int:
    """The keeper's exit code for its child's wait status (see the module docstring)."""
    if os.WIFSIGNALED(status):
        return 0
    return os.WEXITSTATUS(status)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m elastor_mcore.elastic.rank.keeper MODULE [ARGS...]",
              file=sys.stderr)
        return 2
    die_with_parent()
    pid = os.fork()
    if pid == 0:
        run_child(argv[0], argv[1:])
    for sig in (signal.SIGINT, signal.SIGTERM):  # the child gets them from the group
        signal.signal(sig, signal.SIG_IGN)
    _, status = os.waitpid(pid, 0)
    return exit_code(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
