"""Background worker processes for tokenisation, and the pool that feeds them.

Workers are plain ``python -m elastor_mcore.data.workers`` subprocesses talking over
a socket pair with pickled messages. Unlike ``multiprocessing``'s spawn they never
re-import the training script (which would load torch and Megatron, seconds per
worker), and unlike fork they are safe to start after threads or process groups exist.
A worker exits when its socket closes, so it cannot outlive a crashed trainer.

A task is any picklable object with ``run(context) -> result``; its module must not
import torch, to keep worker start-up fast. ``WorkerContext.cached`` lets tasks keep
heavy objects (tokenizer, document index) alive across tasks.
"""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import threading
import traceback
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Protocol

from elastor_mcore.data.errors import DataError


class WorkerContext:
    """Per-worker memo of objects that are expensive to build (one per key)."""

    def __init__(self) -> None:
        self._objects: dict[Any, Any] = {}

    def cached(self, key: Any, factory: Callable[[], Any]) -> Any:
        if key not in self._objects:
            self._objects[key] = factory()
        return self._objects[key]


class Task(Protocol):
    def run(self, context: WorkerContext) -> Any:
        ...


def _serve(conn: Connection) -> None:
    context = WorkerContext()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):   # the trainer closed the pool or is gone
            return
        task_id, task = message
        try:
            reply = (task_id, True, task.run(context))
        except DataError as exc:
            reply = (task_id, False, str(exc))
        except Exception:  # report anything else with its traceback, then keep serving
            reply = (task_id, False, f"data worker failed:\n{traceback.format_exc()}")
        try:
            conn.send(reply)
        except OSError:   # the trainer is gone
            return


class WorkerPool:
    """``num_workers`` background processes; results come back by task id.

    ``submit`` hands a task to the least-loaded worker; a receiver thread collects
    results as they arrive, so workers never block on a full socket while the
    trainer is busy: the caller bounds how much it submits ahead.
    """

    def __init__(self, num_workers: int) -> None:
        if num_workers < 1:
            raise DataError(f"the number of data workers must be at least 1, got {num_workers}")
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (package_root, env.get("PYTHONPATH")) if p)
        # Parallelism comes from the number of workers, not from threads inside each.
        env["RAYON_NUM_THREADS"] = "1"
        env["TOKENIZERS_PARALLELISM"] = "false"
        self._conns: list[Connection] = []
        self._procs: list[subprocess.Popen] = []
        for _ in range(num_workers):
            ours, theirs = socket.socketpair()
            self._procs.append(subprocess.Popen(
                [sys.executable, "-m", "elastor_mcore.data.workers", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), env=env))
            theirs.close()
            self._conns.append(Connection(ours.detach()))
        self._lock = threading.Condition()
        self._results: dict[int, tuple[bool, Any]] = {}
        self._outstanding: list[set[int]] = [set() for _ in range(num_workers)]
        self._next_id = 0
        self._closed = False
        self._receiver = threading.Thread(target=self._receive, name="elastor-data-receiver",
                                          daemon=True)
        self._receiver.start()

    @property
    def num_workers(self) -> int:
        return len(self._procs)

    def submit(self, task: Task) -> int:
        """Queue ``task`` on the least-loaded worker; returns its task id."""
        with self._lock:
            if self._closed:
                raise DataError("the data worker pool is closed")
            worker = min(range(len(self._conns)), key=lambda w: len(self._outstanding[w]))
            task_id = self._next_id
            self._next_id += 1
            self._outstanding[worker].add(task_id)
        self._conns[worker].send((task_id, task))
        return task_id

    def ready(self, task_id: int) -> bool:
        with self._lock:
            return task_id in self._results

    def result(self, task_id: int) -> Any:
        """Wait for a task's result; a worker's failure is re-raised as DataError."""
        with self._lock:
            self._lock.wait_for(lambda: task_id in self._results)
            ok, value = self._results.pop(task_id)
        if not ok:
            raise DataError(value)
        return value

    def imap(self, tasks: Iterable[Task]) -> Iterator[Any]:
        """Results of ``tasks`` in order, keeping two tasks per worker queued: enough to
        keep every worker busy without reading far ahead of the consumer."""
        pending = iter(tasks)
        inflight = [self.submit(t) for t in itertools.islice(pending, 2 * self.num_workers)]
        while inflight:
            result = self.result(inflight.pop(0))
            following = next(pending, None)
            if following is not None:
                inflight.append(self.submit(following))
            yield result

    def _receive(self) -> None:
        live = dict(enumerate(self._conns))
        while live:
            for conn in wait(list(live.values())):
                worker = next(w for w, c in live.items() if c is conn)
                try:
                    task_id, ok, value = conn.recv()
                except (EOFError, OSError):
                    del live[worker]
                    self._worker_gone(worker)
                    continue
                with self._lock:
                    self._outstanding[worker].discard(task_id)
                    self._results[task_id] = (ok, value)
                    self._lock.notify_all()

    def _worker_gone(self, worker: int) -> None:
        try:
            code = self._procs[worker].wait(timeout=1)
        except subprocess.TimeoutExpired:
            code = None
        with self._lock:
            for task_id in self._outstanding[worker]:
                self._results[task_id] = (False, f"data worker {worker} exited unexpectedly "
                                                  f"(exit code {code}) before finishing its work")
            self._outstanding[worker].clear()
            self._lock.notify_all()

    def close(self) -> None:
        """Stop the workers now (queued work is dropped; workers hold no state) and reap them."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for proc in self._procs:
            proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._receiver.join()
        for conn in self._conns:
            conn.close()

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str]) -> None:
    """Worker entry point: serve tasks on the inherited socket until it closes."""
    _serve(Connection(int(argv[0])))


if __name__ == "__main__":
    main(sys.argv[1:])
