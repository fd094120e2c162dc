"""The background half of an asynchronous save, on one rank.

A background thread must never run collectives: the training loop keeps using the
same process groups, and gloo/NCCL order collectives per group, so two threads on one
group deadlock or mix up their messages. Ranks therefore talk through the file
system only:

* the temporary directory's name carries a token the coordinator chose for this save,
  so no rank can mistake a stale directory of an earlier, interrupted save for it;
  the coordinator first removes such stale ``.tmp_*`` entries;
* every writer writes its units from the staged copies, then a marker in the step's
  temporary directory: ``done.rank<N>`` once its files are durable (TensorStore
  fsyncs each file), or ``failed.rank<N>`` holding the error;
* the coordinator also writes the array metadata and its own units, then waits for
  every other writer's marker (noticing failures at once, giving up after a timeout),
  removes the markers and commits (manifest, rename, ``latest``, prune).

If any rank dies before the commit, the directory keeps its ``.tmp_`` name: loaders
never see it and the next save, or the next start, deletes it. On object storage the
step is written in place (``writer.staging_dir``) and the markers are objects in it;
a step without its manifest is as invisible, and as deleted, as a ``.tmp_`` one.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from elastor_mcore.checkpoint.format import CheckpointError
from elastor_mcore.checkpoint.location import ObjectPath
from elastor_mcore.checkpoint.plan import WritePlan
from elastor_mcore.checkpoint.writer import (
    Sources, commit, fsync_dir, remove, remove_stale, write_durably, write_share)

log = logging.getLogger(__name__)

_POLL_S = 0.01
_POLL_OBJECT_S = 0.1
"""Marker polls on object storage cost requests: ten a second."""


def done_marker(tmp: Path | ObjectPath, rank: int) -> Path | ObjectPath:
    return tmp / f"done.rank{rank}"


def failed_marker(tmp: Path | ObjectPath, rank: int) -> Path | ObjectPath:
    return tmp / f"failed.rank{rank}"


@dataclass(frozen=True)
class WriteJob:
    """Everything the background thread of one rank needs for one save."""

    step: int
    tmp: Path | ObjectPath
    path: Path | ObjectPath
    plan: WritePlan
    sources: Sources
    """This rank's units with their staged copies (owned by the job until it ends)."""
    rank: int
    coordinator: bool
    manifest_extra: dict[str, Any] | None
    on_commit: Callable[[], None] | None
    commit_timeout_s: Callable[[float], float]
    """How long the coordinator waits for the other writers' markers, given the
    seconds its own share took (``SavePolicy.commit_timeout_s``)."""


class BackgroundSave:
    """Runs one ``WriteJob`` on a daemon thread; ``join`` returns its error, if any."""

    def __init__(self, job: WriteJob) -> None:
        self.job = job
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"elastor-save-step{job.step}")
        self._thread.start()

    def running(self) -> bool:
        return self._thread.is_alive()

    def join(self) -> BaseException | None:
        self._thread.join()
        return self.error

    def _run(self) -> None:
        job = self.job
        start = time.perf_counter()
        marks = not job.coordinator and bool(job.sources)  # the coordinator waits for it
        try:
            if job.coordinator:
                remove_stale(job.tmp.parent, keep=job.tmp.name)
            write_share(job.tmp, job.plan, job.sources, job.coordinator)
            if marks:
                write_durably(done_marker(job.tmp, job.rank), f"{time.time()}\n")
        except BaseException as exc:  # reported through the marker and join()
            self.error = exc
            if marks:
                _mark_failed(job.tmp, job.rank, exc)
            return
        if not job.coordinator:
            log.info("rank %d wrote its part of step %d in %.3fs", job.rank, job.step,
                     time.perf_counter() - start)
            return
        try:
            others = sorted({u.writer for u in job.plan.units} - {job.rank})
            own_s = time.perf_counter() - start
            wait_for_markers(job.tmp, others, job.commit_timeout_s(own_s))
            for rank in others:
                done_marker(job.tmp, rank).unlink()
            commit(job.tmp, job.path, job.step, job.plan, job.manifest_extra, job.on_commit)
            log.info("step %d committed in the background %.3fs after the save began",
                     job.step, time.perf_counter() - start)
        except BaseException as exc:
            self.error = exc


def _mark_failed(tmp: Path | ObjectPath, rank: int, exc: BaseException) -> None:
    """Best effort on a full disk: an empty file needs no data blocks, the message may
    not fit."""
    marker = failed_marker(tmp, rank)
    if isinstance(marker, ObjectPath):
        try:
            marker.write_text(f"{type(exc).__name__}: {exc}")
        except CheckpointError as marker_error:
            log.error("rank %d could not write %s (%s); the coordinator will time out",
                      rank, marker, marker_error)
        return
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, f"{type(exc).__name__}: {exc}".encode())
        except OSError:
            pass
        finally:
            os.close(fd)
        fsync_dir(tmp)
    except OSError as marker_error:
        log.error("rank %d could not write %s (%s); the coordinator will time out",
                  rank, marker, marker_error)


def wait_for_markers(tmp: Path | ObjectPath, ranks: list[int], timeout_s: float) -> None:
    """Until every rank in ``ranks`` has written ``done.rank<N>``; raise at the first
    ``failed.rank<N>`` or when ``timeout_s`` passes."""
    pending = set(ranks)
    deadline = time.monotonic() + timeout_s
    while pending:
        for rank in sorted(pending):
            failed = failed_marker(tmp, rank)
            if failed.is_file():
                message = failed.read_text(errors="replace") or "(no message: disk full?)"
                raise CheckpointError(f"rank {rank} failed to write its part of {tmp}: "
                                      f"{message}")
            if done_marker(tmp, rank).is_file():
                pending.discard(rank)
        if not pending:
            return
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"rank(s) {sorted(pending)} did not finish writing {tmp} within "
                f"{timeout_s:.0f}s; the step is not committed. Check those ranks' logs, or "
                f"raise SavePolicy.commit_timeout_floor_s for slow storage")
        time.sleep(_POLL_OBJECT_S if isinstance(tmp, ObjectPath) else _POLL_S)


def discard(tmp: Path | ObjectPath) -> None:
    """Remove a temporary directory a failed save left (the previous steps stay)."""
    if tmp.exists():
        remove(tmp)
        log.info("removed %s of a failed save", tmp)
