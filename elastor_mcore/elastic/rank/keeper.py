"""The process torchrun starts for a rank under the supervisor:
``torchrun ... -m elastor_mcore.elastic.rank.keeper [--in-place] MODULE ARGS...``.

It imports no torch and only starts the rank (``MODULE`` with its ``ARGS``) and waits:

- **Where the rank comes from.** With ``ELASTOR_ZYGOTE`` naming the socket of a
  pre-imported worker (``zygote``, which the launcher starts once), the rank is forked
  from it, torch and Megatron-Core already imported; else (or if the zygote is not
  there within ``ZYGOTE_WAIT_S``) from this process, importing them itself. The keeper
  forwards SIGINT and SIGTERM to a rank from the zygote and its process group (a
  forked rank is in the keeper's process group and gets them itself), and a rank from
  the zygote dies with the keeper's connection.
- **Its exit code.** The rank exits 0: so does the keeper. The rank exits non-zero (an
  error, or a recovery in place that failed): so does the keeper; torchrun then stops
  the launch and the supervisor relaunches. The rank ends by a signal (a crash,
  SIGKILL, killed as hung by the supervisor): 128 + the signal, as a shell says;
  with ``--in-place``, 0, because torchrun stops every worker as soon as one exits
  non-zero and the survivors are recovering in place; the supervisor sees the death by
  the heartbeat's pid.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import socket
import sys
import time

from elastor_mcore.compat.process import die_with_parent, finish_as_python_does, signal_rank
from elastor_mcore.elastic.protocol import ZYGOTE_ENV

ZYGOTE_WAIT_S = 120.0
"""How long a keeper waits for the zygote's socket to appear (it is importing)."""
IN_PLACE = "--in-place"


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
    finish_as_python_does()  # multiprocessing's exit handler stops the rank's children
    os._exit(code)


def exit_code(status: int, in_place: bool) -> int:
    """The keeper's exit code for its rank's wait status (see the module docstring)."""
    if os.WIFSIGNALED(status):
        return 0 if in_place else 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def connect(path: str) -> socket.socket | None:
    """The zygote's socket, once it exists (None after ``ZYGOTE_WAIT_S``)."""
    deadline = time.monotonic() + ZYGOTE_WAIT_S
    while True:
        try:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(path)
            return conn
        except OSError as exc:
            conn.close()
            if isinstance(exc, ConnectionRefusedError):  # its socket outlived it
                print(f"keeper: the zygote at {path} is gone; starting the rank cold",
                      file=sys.stderr, flush=True)
                return None
            if time.monotonic() > deadline:
                print(f"keeper: no zygote at {path} after {ZYGOTE_WAIT_S:.0f}s; starting "
                      f"the rank cold", file=sys.stderr, flush=True)
                return None
            time.sleep(0.05)


def lines(conn: socket.socket):
    """The zygote's answers, one per line (the pid, then the wait status)."""
    buffer = b""
    while True:
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            yield int(line)
        data = conn.recv(64)
        if not data:
            return
        buffer += data


def from_zygote(conn: socket.socket, module: str, args: list[str]) -> int:
    """Have the zygote fork the rank; its wait status (SIGKILL's if the zygote died)."""
    request = {"module": module, "argv": args, "env": dict(os.environ), "cwd": os.getcwd(),
               "path": sys.path}
    socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
    answers = lines(conn)
    pid = next(answers)

    def forward(signum, _frame) -> None:
        signal_rank(pid, signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    return next(answers, signal.SIGKILL)


def forked(module: str, args: list[str]) -> int:
    """Fork the rank from this process; its wait status."""
    pid = os.fork()
    if pid == 0:
        run_child(module, args)
    for sig in (signal.SIGINT, signal.SIGTERM):  # the rank gets them from the group
        signal.signal(sig, signal.SIG_IGN)
    return os.waitpid(pid, 0)[1]


def main(argv: list[str]) -> int:
    in_place = bool(argv) and argv[0] == IN_PLACE
    argv = argv[1:] if in_place else argv
    if not argv:
        print(f"usage: python -m elastor_mcore.elastic.rank.keeper [{IN_PLACE}] MODULE "
              f"[ARGS...]", file=sys.stderr)
        return 2
    die_with_parent()
    path = os.environ.get(ZYGOTE_ENV)
    conn = connect(path) if path else None
    status = from_zygote(conn, argv[0], argv[1:]) if conn else forked(argv[0], argv[1:])
    return exit_code(status, in_place)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
