"""The saves of one training run: synchronous or asynchronous, with stated policies
for a save that falls due while another is still being written and for a save that
fails.

An asynchronous ``save`` blocks only for one integer all-reduce (plus the plan
step the first time, ``writer.plan_save``) and a copy of the rank's units into reused host buffers
(``staging``); the writes and the commit run in the background (``background``). At most one save is in flight. It is finished (its
error, if any, raised or logged on every rank, by ``SavePolicy.on_error``) by the
next ``save``, by ``wait`` or by ``close``, which every rank of the group calls
together.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any, Sequence

from elastor_mcore.checkpoint import comm, writer
from elastor_mcore.checkpoint.background import BackgroundSave, WriteJob, discard
from elastor_mcore.checkpoint.format import (
    CheckpointError, ChunkPolicy, latest_step, step_dir_name)
from elastor_mcore.checkpoint.gc_pause import gc_paused
from elastor_mcore.checkpoint.plan import NO_REPLICAS, LocalShard, Replicas, WritePlan
from elastor_mcore.checkpoint.staging import HostStaging
from elastor_mcore.checkpoint.storage import as_path, retrying, storage_for
from elastor_mcore.checkpoint.writer import (
    check_step, open_tmp, plan_save, plan_sources, point_latest, validate, wait_for_pruning)
from elastor_mcore.config.run import SaveOptions

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SavePolicy(SaveOptions):
    """How a run saves: the run settings' ``SaveOptions`` (asynchronous, wait for a busy
    save, stop on error, keep 2 by default) and the commit timeouts."""

    commit_timeout_floor_s: float = 300.0
    commit_timeout_factor: float = 20.0
    """How long the coordinator waits for the other writers' data once its own share
    is written: ``factor`` times its own write time (writers get balanced shares), and
    at least ``floor`` seconds. A writer that died never leaves its marker; this ends
    the wait with an error instead of waiting forever."""

    def __post_init__(self) -> None:
        if self.when_busy not in ("wait", "skip"):
            raise CheckpointError(f"SavePolicy.when_busy must be 'wait' or 'skip', got "
                                  f"{self.when_busy!r}")
        if self.on_error not in ("stop", "continue"):
            raise CheckpointError(f"SavePolicy.on_error must be 'stop' or 'continue', got "
                                  f"{self.on_error!r}")
        check_step(0, self.keep)
        if self.commit_timeout_floor_s <= 0 or self.commit_timeout_factor <= 0:
            raise CheckpointError(
                f"SavePolicy.commit_timeout_floor_s and commit_timeout_factor must be "
                f"positive, got {self.commit_timeout_floor_s} and {self.commit_timeout_factor}")

    def commit_timeout_s(self, own_write_s: float) -> float:
        return max(self.commit_timeout_floor_s, self.commit_timeout_factor * own_write_s)


@dataclass(frozen=True)
class SaveReport:
    """What one ``save`` call did, for the step log."""

    step: int
    block_s: float
    """Time the caller was blocked (the whole save when synchronous)."""
    skipped: bool = False
    """Not saved: the previous save was still running (``when_busy='skip'``)."""


class CheckpointManager:
    """Saves ``root/step_<N>`` for every rank of ``group`` (default: the world);
    ``replicas``: which ranks hold the same shards (``plan.Replicas``)."""

    def __init__(self, root: str | os.PathLike, group=None,
                 chunking: ChunkPolicy | None = None,
                 policy: SavePolicy = SavePolicy(),
                 replicas: Replicas = NO_REPLICAS) -> None:
        self.root = as_path(root)
        self.group = group
        self.replicas = replicas
        self.chunking = chunking or ChunkPolicy()
        self.policy = policy
        self.failures: list[CheckpointError] = []
        """Failed saves (with ``on_error='continue'``), oldest first."""
        self._staging = HostStaging()
        self._comm: comm.Comm | None = None
        self._plan_cache: tuple[str, WritePlan] | None = None
        self._job: BackgroundSave | None = None

    @property
    def in_flight(self) -> bool:
        """Whether this rank's part of a save is still running in the background."""
        return self._job is not None and self._job.running()

    def save(self, step: int, shards: Sequence[LocalShard],
             manifest_extra: dict[str, Any] | None = None) -> SaveReport:
        """Save the state after ``step`` steps (every rank of the group, together).

        Asynchronous: returns once ``shards`` are copied; the caller may then change
        them. Synchronous: returns once the step is committed.
        """
        start = time.perf_counter()
        check_step(step, self.policy.keep)
        if not self.policy.asynchronous:
            try:
                writer.save(self.root, step, shards, manifest_extra, self.group,
                            self.policy.keep, self.chunking, self.replicas)
            except CheckpointError as exc:
                self._failed(exc, step)
            return SaveReport(step, time.perf_counter() - start)
        if (self._job is not None and self.policy.when_busy == "skip"
                and self._ranks().sum([self.in_flight])[0]):
            log.warning("skipping the save of step %d: the save of step %d is still being "
                        "written (when_busy='skip')", step, self._job.job.step)
            return SaveReport(step, time.perf_counter() - start, skipped=True)
        with gc_paused():
            self._job = self._start(step, shards, manifest_extra)
        return SaveReport(step, time.perf_counter() - start)

    def wait(self) -> None:
        """Finish the save in flight, if any (every rank of the group, together)."""
        if self._job is not None:
            job, self._job = self._job, None
            error = job.join()
            self._settle(job, [m for m, in self._ranks().failures(error)])

    def close(self) -> None:
        """Finish the save in flight and the deletion of pruned steps."""
        self.wait()
        wait_for_pruning()

    def _ranks(self) -> comm.Comm:
        if self._comm is None:
            self._comm = comm.Comm(self.group)
        return self._comm

    def _start(self, step: int, shards: Sequence[LocalShard],
               manifest_extra: dict[str, Any] | None) -> BackgroundSave | None:
        """The blocking part: finish the previous save, agree (one integer all-reduce;
        the errors' messages only if some rank failed), plan (only when some rank's
        shards changed geometry), stage, and hand the rest to a background thread
        (None: the save failed at once, under ``on_error``)."""
        previous, self._job = self._job, None
        if previous is not None and previous.running():
            log.info("the save of step %d waits for the save of step %d to finish "
                     "(when_busy='wait')", step, previous.job.step)
        previous_error = previous.join() if previous is not None else None
        ranks = self._ranks()
        coordinator = ranks.is_coordinator
        path = self.root / step_dir_name(step)
        storage = storage_for(path)
        error = storage_error = None
        try:
            validate(shards, step, manifest_extra, coordinator)
        except CheckpointError as exc:
            error = exc
        if error is None and coordinator and storage.writes_in_place:
            try:
                open_tmp(path, clean_root=False)  # cleared before any writer starts
            except Exception as exc:  # any storage error: the save fails, under on_error
                storage_error = exc
        infos = [s.info() for s in shards]
        digest = hashlib.sha1(repr(infos).encode()).hexdigest()
        changed = self._plan_cache is None or self._plan_cache[0] != digest
        token = secrets.randbits(31) + 1 if coordinator else 0
        errors = (previous_error, error, storage_error)
        *failed, changed, token = ranks.sum([e is not None for e in errors] + [changed, token])
        failures = ranks.messages(*errors) if any(failed) else []
        if previous is not None:
            self._settle(previous, [f[0] for f in failures])
        what = f"checkpoint save of step {step} to {path}"
        comm.check([f[1] for f in failures], what, error)
        try:
            comm.check([f[2] for f in failures], what, storage_error)
        except CheckpointError as exc:
            self._failed(exc, step)
            return None
        if changed:  # a run's fixed layout plans once
            self._plan_cache = (digest, plan_save(ranks, infos, self.chunking, what,
                                                  replicas=self.replicas))
        plan = self._plan_cache[1]
        staged = self._staging.stage(plan_sources(plan, shards))
        keep, root = self.policy.keep, self.root
        return BackgroundSave(WriteJob(
            step=step, tmp=storage.staging_dir(path, f"{token:08x}"),
            path=path, plan=plan, sources=staged, rank=ranks.rank, ranks=tuple(ranks.ranks),
            coordinator=coordinator,
            manifest_extra=manifest_extra, on_commit=lambda: point_latest(root, step, keep),
            commit_timeout_s=self.policy.commit_timeout_s))

    def _settle(self, job: BackgroundSave, messages: list[str | None]) -> None:
        """Apply ``on_error`` if any rank's part of ``job`` failed."""
        try:
            comm.check(messages, f"checkpoint save of step {job.job.step} to {job.job.path}",
                       job.error)
        except CheckpointError as exc:
            if job.job.coordinator:
                try:
                    discard(job.job.tmp)  # every rank has joined: nobody writes there now
                except Exception as cleanup:  # a failing store: the next save clears it
                    log.warning("could not remove %s of the failed save (%s); the next "
                                "save removes it", job.job.tmp, cleanup)
            self._failed(exc, job.job.step)

    def _failed(self, exc: CheckpointError, step: int) -> None:
        """Apply ``on_error`` to a failed save, with the error every rank agreed on."""
        try:
            previous = retrying(lambda: latest_step(self.root), f"listing {self.root}")
            kept = (f"the previous checkpoint (step {previous}) is intact"
                    if previous is not None else "no earlier checkpoint exists")
        except Exception as listing:  # a failing store: say so rather than fail here
            kept = f"the earlier checkpoints could not be listed ({listing})"
        hint = (" The file system is full: free space, lower the number of kept "
                "checkpoints, or save elsewhere." if "No space left" in str(exc) else "")
        error = CheckpointError(f"{exc}.{hint} Step {step} was not saved; {kept}.")
        if self.policy.on_error == "stop":
            raise error from exc
        log.error("%s Training continues (on_error='continue').", error)
        self.failures.append(error)
