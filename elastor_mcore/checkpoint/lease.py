"""One writer per checkpoint root: a lease file that a saving job holds while it runs.

Two jobs saving into one root would prune, clean up and commit over each other (a
restarted job once resumed from a step that orphaned ranks of the old job committed
after the "kill"). The launcher of a job that saves (``elastor train --save``, the
supervisor of ``elastor launch`` for all its launches) takes the lease before any
rank starts and refreshes it while the job runs:

* a root without a lease, or with a lease of the same job id, is taken at once;
* a lease whose owner stopped refreshing it for ``stale_after_s`` (a crashed job on
  any host), or whose processes are all gone (same host), is taken over, logged;
* otherwise the job is refused with a message naming the owner.

The lease names the launcher and, at every refresh (and whenever the launcher starts a
job's processes, ``refresh``), every process it has started that is still running
(torchrun, its ranks, their helpers): a launcher that was SIGKILLed leaves ranks that
are still stopping, and saving, for a moment; the lease is not taken over before the
last of them is gone.

Loading needs no lease. The storage backend provides the primitives
(``Storage.create_exclusive``, ``overwrite``, ``remove_once``): on a file system
creation is ``O_EXCL`` and a take-over first renames the stale file away, so of two
jobs racing for one root exactly one wins; on object storage the lease is an object
created by a conditional PUT (create only), and a take-over deletes the stale one
first.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field, replace

import psutil

from elastor_mcore.checkpoint.format import CheckpointError
from elastor_mcore.checkpoint.storage import as_path, storage_for

log = logging.getLogger(__name__)

LEASE_FILE = ".elastor-lease.json"
"""The lease's name inside a checkpoint root (not a step, never pruned or cleaned)."""


class LeaseError(CheckpointError):
    """The root is leased by another running job."""


@dataclass(frozen=True)
class LeaseOwner:
    job_id: str
    host: str
    pid: int
    """The launcher holding the lease."""
    pid_started: float
    """The launcher's start time (tells a reused pid from the owner)."""
    started_at: float
    refreshed_at: float
    writers: list[tuple[int, float]] = field(default_factory=list)
    """(pid, start time) of the launcher's descendants at the last refresh: the job's
    processes on this host that may still write."""

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started_at))
        return (f"job {self.job_id} (pid {self.pid} on {self.host}, started {started}, "
                f"last refreshed {time.time() - self.refreshed_at:.0f}s ago)")

    def alive(self, stale_after_s: float) -> bool:
        """Whether the owner may still be running: refreshed recently and, on this
        host, its launcher or one of the processes it started still exists."""
        if time.time() - self.refreshed_at > stale_after_s:
            return False
        if self.host != socket.gethostname():
            return True
        return any(running(pid, started)
                   for pid, started in [(self.pid, self.pid_started), *self.writers])


def running(pid: int, started: float) -> bool:
    """Whether process ``pid``, started at ``started``, is still running (a reused pid
    has another start time; a zombie has exited)."""
    try:
        process = psutil.Process(pid)
        return abs(process.create_time() - started) < 1.0 and \
            process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def descendants() -> list[tuple[int, float]]:
    """(pid, start time) of every process this one started, directly or not."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            found.append((child.pid, child.create_time()))
        except psutil.NoSuchProcess:
            continue
    return found


def new_job_id() -> str:
    return uuid.uuid4().hex[:12]


class CheckpointLease:
    """The lease on ``root`` for job ``job_id``; ``acquire`` before the job starts,
    ``release`` when it ends (also a context manager)."""

    def __init__(self, root: str | os.PathLike, job_id: str, *, stale_after_s: float = 60.0,
                 refresh_s: float = 5.0) -> None:
        if refresh_s >= stale_after_s:
            raise ValueError(f"refresh_s ({refresh_s}) must be shorter than stale_after_s "
                             f"({stale_after_s})")
        self.root, self.job_id = as_path(root), job_id
        self.storage = storage_for(self.root)
        self.stale_after_s, self.refresh_s = stale_after_s, refresh_s
        self.path = self.root / LEASE_FILE
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._owner: LeaseOwner | None = None
        self._writing = threading.Lock()

    def __enter__(self) -> "CheckpointLease":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def read(self) -> LeaseOwner | None:
        """The current owner, None without a (readable) lease."""
        try:
            return LeaseOwner(**json.loads(self.path.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def acquire(self) -> None:
        """Take the lease (see the module docstring) and start refreshing it."""
        self.storage.prepare_root(self.root)
        me = psutil.Process()
        now = time.time()
        self._owner = LeaseOwner(self.job_id, socket.gethostname(), me.pid, me.create_time(),
                                 now, now)
        while not self._create():
            current = self.read()
            if current is None:
                time.sleep(0.5)  # another job may be between its create and its write
                if self.read() is None:  # gone since, or a crash mid-write: retake
                    self._remove_lease()
                continue
            if current.job_id != self.job_id and current.alive(self.stale_after_s):
                raise LeaseError(
                    f"checkpoint root {self.root} is in use by {current.describe()}; two "
                    f"jobs saving into one root would overwrite each other's steps. Stop "
                    f"that job, or save into another directory (--save DIR)")
            if current.job_id != self.job_id:
                log.warning("taking over the lease on %s from %s, which is no longer "
                            "running", self.root, current.describe())
            self._remove_lease()
        self._thread = threading.Thread(target=self._refresh, daemon=True,
                                        name="elastor-lease")
        self._thread.start()

    def release(self) -> None:
        """Stop refreshing and remove the lease if it is still ours."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        current = self.read()
        if current is not None and current.job_id == self.job_id:
            self.path.unlink(missing_ok=True)

    def _create(self) -> bool:
        return self.storage.create_exclusive(self.path, self._record())

    def _remove_lease(self) -> None:
        """Delete the lease; of racing jobs one does it."""
        self.storage.remove_once(self.path, f"{self.job_id}.{os.getpid()}")

    def _record(self) -> bytes:
        return json.dumps(asdict(self._owner)).encode()

    def refresh(self) -> bool:
        """Renew the lease now, naming the processes this one has started (call it once
        a job's processes have started); False if another job has taken it over."""
        with self._writing:
            current = self.read()
            if current is not None and current.job_id != self.job_id:
                log.error("the lease on %s was taken over by %s; this job's saves may "
                          "collide with it", self.root, current.describe())
                return False
            self._owner = replace(self._owner, refreshed_at=time.time(),
                                  writers=descendants())
            self.storage.overwrite(self.path, self._record())
            return True

    def _refresh(self) -> None:
        while not self._stop.wait(self.refresh_s):
            if not self.refresh():
                return
