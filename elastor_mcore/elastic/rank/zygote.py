"""The pre-imported worker: a process that has imported torch, Megatron-Core and the
rank entry points once, and forks a rank on request, so a rank starts in a fraction of
a second instead of importing them again (seconds of CPU each, tens of seconds when
eight ranks start at once on a small machine).

    python -m elastor_mcore.elastic.rank.zygote --socket PATH

It listens on the Unix socket ``PATH`` (created once the imports are done). A client
(``keeper``, which torchrun starts for each rank) sends one request: the module to run
with its argv, environment and working directory, and its stdin, stdout and stderr
(``SCM_RIGHTS``) and its ``sys.path``. The zygote forks; the child takes those, starts a
session of its own
(the supervisor stops a rank by its process group) and runs the module as ``python -m``
would. The zygote answers with the child's pid and, when the child ends, its wait
status. The child's life is tied to the client's: if the client's connection closes
first (the keeper was killed), the zygote SIGKILLs the child's process group (the
rank's own children too); if the zygote dies, its children get SIGKILL
(``compat.process``). The child ends as ``python -m`` would
(``compat.process.finish_as_python_does``).

One thread (a selector over the socket, the clients and a self-pipe for ``SIGCHLD``):
nothing else runs when it forks.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import selectors
import signal
import socket
import sys
import time
import warnings
from typing import Sequence

from elastor_mcore.compat.process import die_with_parent, signal_rank

log = logging.getLogger(__name__)

PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "megatron.core.models.gpt",
           "tensorstore", "elastor_mcore.elastic.rank.worker",
           "elastor_mcore.elastic.rank.node_worker")
"""What the children find imported: the heavy part of every rank's start. Torch's
optimizers import ``torch._dynamo`` when the first one is built (0.5-1.6 CPU-s a rank,
measured), although nothing is compiled."""
MAX_REQUEST = 1 << 20


def preload(extra: Sequence[str] = ()) -> float:
    """Import ``PRELOAD``, then the workload's ``extra`` modules; returns the seconds it
    took. An extra module that fails to import is left to the ranks, which then fail on
    it themselves, as cold ranks would."""
    start = time.perf_counter()
    warnings.filterwarnings("ignore")
    for name in PRELOAD:
        __import__(name)
    for name in extra:
        try:
            __import__(name)
        except Exception as exc:  # the ranks' own import says what is wrong
            log.warning("zygote: could not pre-import %s (%s); its ranks import it "
                        "themselves", name, exc)
    return time.perf_counter() - start


def read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """One request: a JSON line, the client's stdio descriptors with its first bytes."""
    data, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, 3)
    while not data.endswith(b"\n"):
        more = conn.recv(MAX_REQUEST)
        if not more:
            raise ConnectionError("the client closed before its request was complete")
        data += more
    return json.loads(data), fds


def become(request: dict, fds: list[int], close: list[int]) -> None:
    """In the child: take the client's stdio, environment and directory; run the
    module; never returns."""
    from elastor_mcore.elastic.rank.keeper import run_child

    for fd in close:
        with contextlib.suppress(OSError):
            os.close(fd)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    os.setsid()
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.path[:] = request["path"]  # the client's PYTHONPATH, as its interpreter saw it
    importlib.invalidate_caches()
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    forget_logging_setup()
    run_child(request["module"], request["argv"])


def forget_logging_setup() -> None:
    """Leave the root logger as a fresh interpreter has it (no handler, WARNING), not
    as ``main`` set it up: otherwise the rank's own ``logging.basicConfig`` (Megatron-LM
    calls it) does nothing, and its INFO lines are lost."""
    root = logging.getLogger()
    for handler in root.handlers[:]:
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)


class Zygote:
    """The server loop (see the module docstring)."""

    def __init__(self, path: str) -> None:
        self.selector = selectors.DefaultSelector()
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self.server.bind(path + ".tmp")
        os.rename(path + ".tmp", path)  # appears whole, once ready
        self.server.listen(64)
        self.selector.register(self.server, selectors.EVENT_READ, "accept")
        self.wakeup_r, wakeup_w = os.pipe()
        os.set_blocking(self.wakeup_r, False)
        os.set_blocking(wakeup_w, False)
        signal.set_wakeup_fd(wakeup_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.selector.register(self.wakeup_r, selectors.EVENT_READ, "child")
        self.children: dict[int, socket.socket] = {}
        self.client_of: dict[socket.socket, int | None] = {}

    def serve(self) -> None:
        while True:
            for key, _ in self.selector.select():
                if key.data == "accept":
                    conn, _ = self.server.accept()
                    self.client_of[conn] = None
                    self.selector.register(conn, selectors.EVENT_READ, "client")
                elif key.data == "child":
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self.wakeup_r, 512):
                            pass
                    self.reap()
                elif key.fileobj in self.client_of:  # not dropped earlier in this batch
                    try:
                        self.from_client(key.fileobj)
                    except Exception:  # one client's trouble must not end the zygote
                        log.exception("zygote: serving a client failed")
                        self.drop(key.fileobj)

    def from_client(self, conn: socket.socket) -> None:
        pid = self.client_of[conn]
        if pid is not None:  # a started rank's client closed: the rank goes with it
            self.drop(conn)
            signal_rank(pid, signal.SIGKILL)
            return
        try:
            request, fds = read_request(conn)
        except (OSError, ValueError) as exc:
            log.warning("zygote: a bad request (%s)", exc)
            self.drop(conn)
            return
        keep = [conn.fileno()]
        close = [self.server.fileno(), self.wakeup_r, self.selector.fileno(),
                 *(c.fileno() for c in self.client_of if c.fileno() not in keep)]
        pid = os.fork()
        if pid == 0:
            become(request, fds, close + keep)
        for fd in fds:
            os.close(fd)
        self.client_of[conn] = pid
        self.children[pid] = conn
        conn.sendall(f"{pid}\n".encode())
        log.info("zygote: forked %d for %s", pid, request["module"])

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is not None and conn in self.client_of:
                with contextlib.suppress(OSError):
                    conn.sendall(f"{status}\n".encode())
                self.drop(conn)

    def drop(self, conn: socket.socket) -> None:
        """Forget a client (its rank, if still running, is reaped without it)."""
        self.selector.unregister(conn)
        self.client_of.pop(conn)
        conn.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="elastor_mcore.elastic.rank.zygote")
    parser.add_argument("--socket", required=True, help="the Unix socket to listen on")
    parser.add_argument("--import", dest="imports", action="append", default=[],
                        metavar="MODULE", help="also pre-import MODULE (the workload's)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("ELASTOR_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(name)s: %(message)s")
    die_with_parent()  # the launcher that started it is gone: so is the job
    took = preload(args.imports)
    zygote = Zygote(args.socket)
    log.info("zygote: imported %s in %.1fs; serving on %s",
             ", ".join([*PRELOAD, *args.imports]), took, args.socket)
    zygote.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
