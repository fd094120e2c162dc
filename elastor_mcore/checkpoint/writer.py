"""Save: every rank writes its share of the files, then rank 0 commits.

Order of a synchronous save, in two job-wide steps as DCP's (each carries every rank's
error, so a failure anywhere stops every rank): every rank validates and rank 0
creates ``.tmp_<name>/`` -> **plan** (``plan_save``: shard boxes to the owners of their
tensors, each rank's part of the plan back) -> every rank writes its units and its
share of the array metadata (each file fsynced) -> **finish**: every rank's write
errors agreed; rank 0 writes ``manifest.json`` last, renames the directory into
place, moves ``latest`` and prunes old steps (renamed away at once, deleted on a
background thread), and tells every rank how the commit went -> return. A crash at
any point leaves the previous steps loadable.

How the directory becomes visible is the storage backend's commit protocol
(``checkpoint.storage``): the steps above are the file system's; on object storage
(no rename, no ``fsync``) the step is written in place, first cleared (its manifest
first), and the manifest, written last, commits it. See docs/checkpoint-format.md.

The steps are separate functions because the asynchronous save
(``checkpoint.background``) runs the same ones, split between the caller and a
background thread.
"""

from __future__ import annotations

import json
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from elastor_mcore.checkpoint import comm, fast_write
from elastor_mcore.checkpoint.format import (
    FORMAT_VERSION, LATEST, CheckpointError, ChunkPolicy, Manifest, TensorEntry,
    committed_steps, parse_step, step_dir_name)
from elastor_mcore.checkpoint.gc_pause import gc_paused
from elastor_mcore.checkpoint.plan import (
    DIGEST_BITS, NO_REPLICAS, LocalPlan, LocalShard, Replicas, WritePlan, WriteUnit,
    expected_digest, merge_entries, plan_disjoint, plan_owned, written_digest)
from elastor_mcore.checkpoint.storage import MANIFEST, TMP_PREFIX, Location, as_path, storage_for
from elastor_mcore.checkpoint.store import numpy_view, open_arrays, wait_all
from elastor_mcore.geometry import ShardInfo, local_view

log = logging.getLogger(__name__)

Sources = Sequence[tuple[WriteUnit, torch.Tensor]]
"""The units one rank writes, each with the tensor (view or staged copy) of its box."""


@dataclass(frozen=True)
class SaveResult:
    """A committed step and the plan every rank followed (who wrote which bytes)."""

    path: Location
    step: int
    plan: WritePlan
    calls: int = 0
    """The job-wide collective calls the save made (``comm.Comm.calls``)."""


def save(root: str | os.PathLike, step: int, shards: Sequence[LocalShard],
         manifest_extra: dict[str, Any] | None = None, group=None, keep: int = 2,
         chunking: ChunkPolicy | None = None,
         replicas: Replicas = NO_REPLICAS) -> SaveResult:
    """Save ``shards`` as ``root/step_<N>`` and point ``root/latest`` at it.

    Called by every rank of ``group`` (default: the world) that holds state; replicas
    may overlap (``replicas``: which ranks hold the same shards, so that one of each
    class plans for all; ``plan.Replicas``). Keeps the ``keep`` newest committed steps
    (and always this one). Returns once the step is committed on every rank.
    """
    check_step(step, keep)
    root = as_path(root)
    return write_checkpoint(root / step_dir_name(step), step, shards, manifest_extra,
                            group, chunking, clean_root=True,
                            on_commit=lambda: point_latest(root, step, keep),
                            replicas=replicas)


def write_checkpoint(path: str | os.PathLike, step: int, shards: Sequence[LocalShard],
                     manifest_extra: dict[str, Any] | None = None, group=None,
                     chunking: ChunkPolicy | None = None, *, clean_root: bool = False,
                     on_commit: Callable[[], None] | None = None,
                     replicas: Replicas = NO_REPLICAS,
                     files: Mapping[str, bytes] | None = None) -> SaveResult:
    """Save into exactly ``path`` (atomically replacing it), without a ``latest``
    pointer: the form Megatron-LM's own ``iter_N`` directories need. ``files``: named
    files (paths inside the step directory, with their bytes) this rank offers to
    write beside the arrays, committed with them; where several ranks offer one name
    (the same object on every replica), one of them writes it."""
    with gc_paused():
        return _write_checkpoint(path, step, shards, manifest_extra, group, chunking,
                                 clean_root, on_commit, replicas, files or {})


def _write_checkpoint(path: str | os.PathLike, step: int, shards: Sequence[LocalShard],
                      manifest_extra: dict[str, Any] | None, group,
                      chunking: ChunkPolicy | None, clean_root: bool,
                      on_commit: Callable[[], None] | None,
                      replicas: Replicas, files: Mapping[str, bytes]) -> SaveResult:
    path = as_path(path)
    tmp = storage_for(path).staging_dir(path, "")
    ranks = comm.Comm(group)
    coordinator = ranks.is_coordinator
    what = f"checkpoint save of step {step} to {path}"

    error = None
    try:
        validate(shards, step, manifest_extra, coordinator)
        if coordinator:
            open_tmp(tmp, clean_root)
    except Exception as exc:  # a bad shard, or any storage error creating tmp
        error = exc
    try:
        plan = plan_save(ranks, [s.info() for s in shards], chunking or ChunkPolicy(), what,
                         error, replicas, sorted(files))
    except CheckpointError:
        if coordinator and error is None:
            discard_quietly(tmp)
        raise

    error = None
    try:
        write_share(tmp, plan, plan_sources(plan, shards), coordinator, files)
    except Exception as exc:
        error = exc
    failed, writers, files, digest = ranks.sum([error is not None, bool(plan.units),
                                                len(plan.units), written_digest(plan)])
    if failed:
        comm.check([m for m, in ranks.messages(error)], what, error)

    error = None
    if coordinator:
        try:
            commit(tmp, path, step, plan, manifest_extra, on_commit, writers, files, digest)
        except Exception as exc:
            error = exc
    comm.check([ranks.broadcast(comm.describe(error))], what, error)
    return SaveResult(path, step, plan, ranks.calls)


def plan_save(ranks: comm.Comm, infos: Sequence[ShardInfo], policy: ChunkPolicy, what: str,
              error: BaseException | None = None, replicas: Replicas = NO_REPLICAS,
              files: Iterable[str] = ()) -> WritePlan:
    """The plan step of a save (DCP's: gather local plans, scatter the global one):
    each rank sends its shard descriptions to the owners of its tensors (one member
    of each class of ``replicas`` per column), each owner plans its tensors
    (``plan.plan_tensors``) and sends every holder its cells, and the holders cut
    them into files and choose their writers (``plan.merge``), checking the cells
    against their own shards (``WritePlan.mismatch``). Two sparse exchanges;
    ``error`` (this rank's, before planning) fails the save on every rank. ``files``:
    the named files this rank offers to write beside the arrays; the owner of each
    name picks one writer among the ranks that offer it (``WritePlan.files``).

    Disjoint state with a grid (``Replicas.grid``: ZeRO-1) needs no owner: each rank
    plans its own shards (``plan.plan_disjoint``) and one gather (``Comm.gather``: a
    bitmap ``all_reduce``, then point to point) brings the coordinator the entries of
    the arrays, from the ranks that create them. Mixed state (a grid beside replica
    classes: Megatron-LM's weights and ZeRO-1's optimizer state) plans the grid's
    tensors so and the others through the owners, in the same two exchanges, the
    grid's entries riding to the coordinator in the first."""
    files = tuple(files)
    if replicas.disjoint and replicas.grid is not None:
        if files:
            raise ValueError("a disjoint save plans nothing across ranks, so it cannot "
                             "choose the writers of named files; save them with the "
                             "replicated state's plan (replica classes or none)")
        plan = plan_disjoint(ranks.rank, infos, policy, replicas.grid)
        received = ranks.gather(plan.created_entries() or None, what, error)
        if ranks.is_coordinator:
            plan.entries = merge_entries([plan.entries, *received.values()])
        return plan
    try:
        replicas.check(ranks.ranks)
    except CheckpointError as exc:
        error = error or exc
    local = LocalPlan.build(ranks.rank, infos, ranks.ranks, policy, replicas, files)
    received = ranks.exchange(local.requests, what, error)
    parts, error = {}, None
    try:
        parts, _ = plan_owned(received, ranks.ranks, ranks.ranks.index(ranks.rank),
                              policy, replicas)
    except CheckpointError as exc:
        error = exc
    replies = ranks.exchange(parts, what, error)
    return local.merged(replies.values(), replicas=replicas)


def discard_quietly(tmp: Location) -> None:
    """Remove a save's temporary directory after a failure, logging (not raising) a
    failure to do so: the next save's ``remove_stale`` clears it."""
    try:
        if tmp.exists():
            storage_for(tmp).remove(tmp)
    except Exception as exc:  # any storage error: housekeeping
        log.warning("could not remove %s of a failed save (%s)", tmp, exc)


def check_step(step: int, keep: int) -> None:
    if not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step must be a non-negative integer, got {step!r}")
    if keep < 1:
        raise CheckpointError(f"keep={keep}: at least the step just saved must be kept")


def validate(shards: Sequence[LocalShard], step: int,
             manifest_extra: dict[str, Any] | None, coordinator: bool) -> None:
    """Raise ``CheckpointError`` before any write if a shard or the manifest cannot be
    stored (the coordinator checks the manifest fields)."""
    for shard in shards:
        shard.validate()
    if coordinator:
        Manifest.build(step, {}, 1, manifest_extra).to_json()


def plan_sources(plan: WritePlan, shards: Sequence[LocalShard]) -> Sources:
    """The sources of this rank's units (``unit_sources``); none where its plan does
    not fit its shards (``WritePlan.mismatch``: ``write_share`` fails it)."""
    return [] if plan.mismatch else unit_sources(plan.units, shards)


def unit_sources(units: Sequence[WriteUnit], shards: Sequence[LocalShard]) -> Sources:
    """Each unit with a view of its box in the local shard that holds it."""
    by_key: dict[str, list[LocalShard]] = {}
    for shard in shards:
        by_key.setdefault(shard.key, []).append(shard)
    sources = []
    for unit in units:
        shard = next(s for s in by_key[unit.key] if s.box.contains(unit.box))
        sources.append((unit, local_view(shard.data, shard.box, unit.box)))
    return sources


def write_share(tmp: Location, plan: WritePlan, sources: Sources, coordinator: bool,
                files: Mapping[str, bytes] | None = None) -> None:
    """One rank's part of the data, and the metadata of its share of the arrays (the
    coordinator also the group's): spread over the ranks, as creating 100 arrays'
    metadata took the one rank that did it all 0.05-0.2 s on the save's critical
    path. Nobody waits for the metadata: the data writers create the directories.
    A rank creates the arrays whose first file it writes (``plan.metadata_creators``),
    and writes the named files its plan gives it (``WritePlan.files``, from ``files``).
    A plan that does not fit this rank's shards (``WritePlan.mismatch``) fails here,
    before anything is written."""
    if plan.mismatch:
        raise CheckpointError(f"this rank's part of the plan does not fit its shards: "
                              f"{plan.mismatch}; are the replica classes built from this "
                              f"job's layout, with the optimizer state unsharded?")
    if coordinator:
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "zarr.json").write_text(json.dumps(
            {"zarr_format": 3, "node_type": "group",
             "attributes": {"elastor_format_version": FORMAT_VERSION}}))
    mine = plan.created_entries()
    if mine:
        open_arrays(tmp, mine, create=True)
    _write_units(tmp, plan.entries, sources)
    for name in plan.files:
        write_file(tmp / name, files[name])


def write_file(file: Location, data: bytes) -> None:
    """``data`` as ``file``, durably, its folder made first (a no-op on object
    stores)."""
    file.parent.mkdir(parents=True, exist_ok=True)
    storage_for(file).write_durably(file, data)


def commit(tmp: Location, path: Location, step: int, plan: WritePlan,
           manifest_extra: dict[str, Any] | None,
           on_commit: Callable[[], None] | None, writers: int, files: int,
           digest: int) -> None:
    """Coordinator, once every rank's data is durable (``writers`` of them wrote
    ``files`` files in all, named together by ``digest``, ``plan.written_digest``
    summed): the backend's commit (manifest last), then ``on_commit``. Every plan
    writes each file of every array once; a count or digest that differs (shards that
    leave a gap, or claimed disjoint and overlapping; ranks that disagree on their
    writers) fails the save before the manifest is written."""
    expected = sum(entry.num_files for entry in plan.entries.values())
    if files != expected or digest % 2 ** DIGEST_BITS != expected_digest(plan.entries):
        wrote = (f"{files} files where the arrays of {tmp.name} have {expected}"
                 if files != expected else f"as many files as the arrays of {tmp.name} "
                 f"have, but not those: some twice, others never")
        raise CheckpointError(
            f"the ranks wrote {wrote}: the saving ranks' shards leave part of a tensor "
            f"unwritten or write it twice (with Replicas(disjoint=True), check that no "
            f"two ranks hold the same elements and that together they hold every tensor; "
            f"with replica classes, that every member holds the same shards)")
    storage_for(path).commit_dir(
        tmp, path, Manifest.build(step, plan.entries, writers, manifest_extra).to_json())
    if on_commit is not None:
        on_commit()
    log.info("committed %s (%d tensors, %d bytes)", path, len(plan.entries),
             sum(e.nbytes for e in plan.entries.values()))


def point_latest(root: Location, step: int, keep: int) -> None:
    """Move ``latest`` to the step just committed and prune beyond ``keep``. The step is
    committed already: a failed prune is logged, and the next save prunes again."""
    storage_for(root).write_durably(root / LATEST, step_dir_name(step) + "\n")
    try:
        prune_oldest([(s, root / step_dir_name(s)) for s in committed_steps(root)], keep,
                     root / step_dir_name(step))
    except Exception as exc:  # any storage error: housekeeping, not the save
        log.warning("pruning old steps of %s failed (%s: %s); the next save prunes again",
                    root, type(exc).__name__, exc)


def remove_stale(root: str | os.PathLike | Location, keep: str | None = None) -> None:
    """Delete leftovers of interrupted saves and prunes (``.tmp_*``) under ``root``,
    except the entry named ``keep`` (a save that is starting). Where a backend writes
    in place, a ``step_N`` without its manifest is such a leftover too."""
    root = as_path(root)
    storage = storage_for(root)
    if root.is_dir():
        for entry in root.iterdir():
            abandoned = (storage.writes_in_place and parse_step(entry.name) is not None
                         and not (entry / MANIFEST).is_file())
            if (entry.name.startswith(TMP_PREFIX) or abandoned) and entry.name != keep:
                log.info("removing stale %s", entry)
                storage.remove(entry)


def open_tmp(tmp: Location, clean_root: bool) -> None:
    """Coordinator: a fresh, empty ``tmp`` directory for one save (with
    ``clean_root``, every stale ``.tmp_*`` beside it is removed first)."""
    if clean_root:
        remove_stale(tmp.parent, keep=tmp.name)
    if tmp.exists():
        storage_for(tmp).remove(tmp)
    tmp.mkdir(parents=True)


def begin_single(tmp: Location, entries: dict[str, TensorEntry]) -> None:
    """A one-process writer's first step (converters hold one tensor at a time): a
    fresh ``tmp`` holding every array's metadata, ready for ``write_whole``."""
    open_tmp(tmp, clean_root=False)
    write_share(tmp, WritePlan(entries, [], creates=tuple(entries)), [], coordinator=True)


def write_whole(tmp: Location, key: str, entry: TensorEntry, tensor: torch.Tensor) -> None:
    """Write all of one tensor into the array ``key`` of ``tmp``."""
    array = open_arrays(tmp, {key: entry}, create=False)[key]
    array.write(numpy_view(tensor.detach().cpu().contiguous())).result()


def _write_units(tmp: Location, entries: dict[str, TensorEntry], sources: Sources) -> None:
    """Write this rank's units: whole files by ``fast_write`` where the backend offers
    local files, the rest issued to TensorStore at once, then waited for together."""
    storage = storage_for(tmp)
    direct, rest = [], []
    for unit, data in sources:
        if storage.local_files and fast_write.handles(entries[unit.key], unit.box, data):
            direct.append((unit.key, entries[unit.key], unit.box, data))
        else:
            rest.append((unit, data))
    if direct:
        fast_write.write_files(storage.local_path(tmp), direct)
    if not rest:
        return
    arrays = open_arrays(tmp, {u.key: entries[u.key] for u, _ in rest}, create=False)
    futures = [(unit.key, arrays[unit.key][unit.box.slices()].write(numpy_view(data)).commit)
               for unit, data in rest]
    wait_all(futures, "write")


def prune_oldest(found: Sequence[tuple[int, Location]], keep: int, just_saved: Location) -> None:
    """Delete all but the ``keep`` newest of ``found`` (step, directory), never
    ``just_saved``. Each is first made invisible at once by its backend (``retire``:
    renamed to a ``.tmp_`` name, or its manifest deleted first), so a crash leaves a
    whole step or a leftover ``remove_stale`` clears, never half a step."""
    for _, entry in sorted(found)[:-keep]:
        if entry.resolve() == just_saved.resolve():
            continue
        doomed = storage_for(entry).retire(entry)
        if doomed is not None:
            _delete_in_background(doomed)
        log.info("pruned %s (keeping %d checkpoints)", entry, keep)


_deleter: ThreadPoolExecutor | None = None
_deletions: list[Future] = []


def _delete_in_background(doomed: Location) -> None:
    """Delete a pruned step, already retired, on a background thread: deleting a
    step's files took 0.25 s per GB on the save's critical path (a quarter of a
    steady-state save), and nothing needs to wait for it. A deletion cut short by
    the process's end leaves a ``.tmp_`` entry that the next save clears."""
    global _deleter
    if _deleter is None:
        _deleter = ThreadPoolExecutor(1, thread_name_prefix="elastor-prune")
    _deletions.append(_deleter.submit(storage_for(doomed).remove, doomed))


def wait_for_pruning() -> None:
    """Return once every pruned step handed to the background is deleted."""
    while _deletions:
        _deletions.pop(0).result()
