"""The background half of an asynchronous save, on one rank.

A background thread must never run collectives: the training loop keeps using the
same process groups, and gloo/NCCL order collectives per group, so two threads on one
group deadlock or mix up their messages. Ranks therefore talk through the file
system only:

* the temporary directory's name carries a token the coordinator chose for this save,
  so no rank can mistake a stale directory of an earlier, interrupted save for it;
  the coordinator first removes such stale ``.tmp_*`` entries;
* every rank writes its units from the staged copies (none, where its replicas
  write everything it holds), then a marker in the step's temporary directory:
  ``done.rank<N>`` once its files are durable (TensorStore fsyncs each file),
  holding how many it wrote, or ``failed.rank<N>`` holding the error;
* the coordinator also writes the array metadata and its own units, then waits for
  every other rank's marker (noticing failures at once, giving up after a timeout),
  removes the markers and commits (manifest, rename, ``latest``, prune). No rank
  knows the whole plan: the holders of each set of units chose their writers among
  themselves (``plan.merge``), so the coordinator waits for every rank.

If any rank dies before the commit, the directory keeps its ``.tmp_`` name: loaders
never see it and the next save, or the next start, deletes it. Where the backend
writes in place (object storage, ``Storage.staging_dir``) the markers are objects in
the step itself; a step without its manifest is as invisible, and as deleted, as a
``.tmp_`` one.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from elastor_mcore.checkpoint.format import CheckpointError, parse_step
from elastor_mcore.checkpoint.plan import WritePlan, written_digest
from elastor_mcore.checkpoint.storage import MANIFEST, Location, is_transient, storage_for
from elastor_mcore.checkpoint.writer import Sources, commit, remove_stale, write_share

log = logging.getLogger(__name__)


def done_marker(tmp: Location, rank: int) -> Location:
    return tmp / f"done.rank{rank}"


def failed_marker(tmp: Location, rank: int) -> Location:
    return tmp / f"failed.rank{rank}"


@dataclass(frozen=True)
class WriteJob:
    """Everything the background thread of one rank needs for one save."""

    step: int
    tmp: Location
    path: Location
    plan: WritePlan
    sources: Sources
    """This rank's units with their staged copies (owned by the job until it ends)."""
    rank: int
    ranks: tuple[int, ...]
    """Every rank of the save's group."""
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
        marks = not job.coordinator  # the coordinator waits for every other rank
        try:
            if job.coordinator:
                remove_stale(job.tmp.parent, keep=job.tmp.name)
            write_share(job.tmp, job.plan, job.sources, job.coordinator)
            if marks:
                # a rank that wrote no file may get here before any writer made the
                # step's directory (file storage; a no-op on object stores)
                job.tmp.mkdir(parents=True, exist_ok=True)
                storage_for(job.tmp).write_durably(
                    done_marker(job.tmp, job.rank),
                    f"{time.time()} {len(job.sources)} {written_digest(job.plan)}\n")
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
            others = sorted(set(job.ranks) - {job.rank})
            own_s = time.perf_counter() - start
            wait_for_markers(job.tmp, others, job.commit_timeout_s(own_s))
            wrote = [(len(job.sources), written_digest(job.plan)),
                     *(_wrote(job.tmp, rank) for rank in others)]
            for rank in others:
                done_marker(job.tmp, rank).unlink()
            commit(job.tmp, job.path, job.step, job.plan, job.manifest_extra, job.on_commit,
                   sum(bool(n) for n, _ in wrote), sum(n for n, _ in wrote),
                   sum(d for _, d in wrote))
            log.info("step %d committed in the background %.3fs after the save began",
                     job.step, time.perf_counter() - start)
        except BaseException as exc:
            self.error = exc


def _wrote(tmp: Location, rank: int) -> tuple[int, int]:
    """How many files ``rank``'s done marker says it wrote, and their digest
    (``plan.written_digest``)."""
    _, units, digest = done_marker(tmp, rank).read_text().split()
    return int(units), int(digest)


def _mark_failed(tmp: Location, rank: int, exc: BaseException) -> None:
    """Best effort (``Storage.write_marker``): on a failing store the coordinator times
    out instead."""
    marker = failed_marker(tmp, rank)
    try:
        storage_for(marker).write_marker(marker, f"{type(exc).__name__}: {exc}")
    except Exception as marker_error:  # any storage error: logged, the wait times out
        log.error("rank %d could not write %s (%s); the coordinator will time out",
                  rank, marker, marker_error)


def wait_for_markers(tmp: Location, ranks: list[int], timeout_s: float) -> None:
    """Until every rank in ``ranks`` has written ``done.rank<N>``; raise at the first
    ``failed.rank<N>`` or when ``timeout_s`` passes. A poll that meets a transient
    storage error is repeated at the next poll."""
    pending = set(ranks)
    deadline = time.monotonic() + timeout_s
    while pending:
        for rank in sorted(pending):
            try:
                if _reported(tmp, rank):
                    pending.discard(rank)
            except Exception as exc:  # classified: only a transient error is polled again
                if not is_transient(exc):
                    raise
                log.info("polling the marker of rank %d in %s failed (%s); polling again",
                         rank, tmp, exc)
        if not pending:
            return
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"rank(s) {sorted(pending)} did not finish writing {tmp} within "
                f"{timeout_s:.0f}s; the step is not committed. Check those ranks' logs, or "
                f"raise SavePolicy.commit_timeout_floor_s for slow storage")
        time.sleep(storage_for(tmp).poll_s)


def _reported(tmp: Location, rank: int) -> bool:
    """Whether ``rank`` is done; ``CheckpointError`` with its message if it failed."""
    failed = failed_marker(tmp, rank)
    if failed.is_file():
        message = failed.read_text(errors="replace") or "(no message: disk full?)"
        raise CheckpointError(f"rank {rank} failed to write its part of {tmp}: {message}")
    return done_marker(tmp, rank).is_file()


def discard(tmp: Location) -> None:
    """Remove what a failed save left in ``tmp`` (the previous steps stay). Where the
    backend writes in place and the manifest got written, the step is committed (what
    failed came after, e.g. ``latest``): it is kept, as a renamed one would be."""
    storage = storage_for(tmp)
    if not tmp.exists():
        return
    if storage.writes_in_place and parse_step(tmp.name) is not None \
            and (tmp / MANIFEST).is_file():
        log.warning("%s is committed although its save reported a failure; keeping it", tmp)
        return
    storage.remove(tmp)
    log.info("removed %s of a failed save", tmp)
