"""Load: range reads of exactly the boxes a rank needs, straight into its tensors.

Tensors in elastor's own layout are read by ``fast_read`` (``preadv`` of inner chunks
into the destination, crc32c checked in place); anything else is issued as one
TensorStore batch (so reads of one file are coalesced) into the destination tensors'
own memory, then awaited together. Only committed steps are ever read. A backend
without local files (object storage: ``s3://``, ``gs://``) is always read through
TensorStore, whose range GETs fetch the same inner chunks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import logging
import math
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import tensorstore as ts
import torch

from elastor_mcore.checkpoint import comm, fast_read
from elastor_mcore.checkpoint.format import (
    DTYPE_ITEMSIZE, CheckpointError, Manifest, TensorEntry, read_manifest, resolve_step_dir)
from elastor_mcore.checkpoint.gc_pause import gc_paused
from elastor_mcore.checkpoint.plan import (
    NO_REPLICAS, LocalShard, Replicas, WriteUnit, assign_writers, route)
from elastor_mcore.checkpoint.storage import Location, as_path, retrying, storage_for
from elastor_mcore.checkpoint.store import numpy_view, open_arrays, wait_all
from elastor_mcore.geometry import Box, ShardInfo, common_refinement, grid_cut, local_view

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorInfo:
    """One row of a checkpoint's tensor table."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    chunks: tuple[int, ...]
    files: int


class CheckpointReader:
    """Read-only access to one committed step, without any process group."""

    def __init__(self, step_dir: Location) -> None:
        self.path = step_dir
        self.manifest = read_manifest(step_dir)

    def tensors(self) -> list[TensorInfo]:
        return [TensorInfo(k, e.shape, e.dtype, e.nbytes, e.chunks, e.num_files)
                for k, e in sorted(self.manifest.tensors.items())]

    def read(self, key: str, box: Box | None = None) -> torch.Tensor:
        """The whole global tensor ``key``, or the part of it inside ``box``."""
        entry = _entry(self.manifest, key, self.path)
        box = box or Box((0,) * len(entry.shape), entry.shape)
        out = torch.empty(box.shape, dtype=getattr(torch, entry.dtype))
        read_boxes(self.path, self.manifest, [LocalShard(key, entry.shape, box.offset, out)])
        return out


def open_checkpoint(path: str | os.PathLike) -> CheckpointReader:
    """A reader for ``path``: a ``step_N`` directory, or a root (its latest step)."""
    return CheckpointReader(resolve_step_dir(path))


def load(path_or_root: str | os.PathLike, targets: Sequence[LocalShard],
         group=None, replicas: Replicas = NO_REPLICAS) -> Manifest:
    """Fill every target's ``data`` in place with the checkpoint's bytes for its box.

    Called by every rank of ``group`` (default: the world). With a root directory,
    rank 0 of the group picks the step so all ranks read the same one. Bytes that
    several ranks need (data-parallel replicas, TP replicas of norms) are read from
    storage by one of them and sent to those on other hosts (``SharedReads``). With
    ``replicas`` (which ranks hold the same targets, ``plan.Replicas``, the same on
    every rank), the members of each class share their class's reads among
    themselves (``class_pieces``) and a rank in no class (a class of its own) reads
    its own targets; with ``Replicas(disjoint=True)`` (no bytes held twice: ZeRO-1)
    each rank reads its own targets, and so it does of the tensors in the classes'
    ``grid`` (mixed state: Megatron-LM's weights beside ZeRO-1's optimizer state).
    Either way nothing is planned through owners.
    """
    with gc_paused():
        return _load(path_or_root, targets, group, replicas)


def _load(path_or_root: str | os.PathLike, targets: Sequence[LocalShard], group,
          replicas: Replicas) -> Manifest:
    """Two job-wide steps: **plan** (the step directory, and every rank's targets to the
    owners of their tensors, who send each holder its reads, ``plan_load``; with
    replica classes one ``Comm.announce``, each class's members checking each other's
    targets, ``class_peers``, a rank in no class being a class of its own; with
    disjoint targets the announcement alone, each rank a class of its own), then
    the reads, then **agree** on every rank's errors; then the shared reads'
    messages."""
    ranks = comm.Comm(group)
    what = f"checkpoint load from {path_or_root}"
    error, step_dir = None, None
    try:
        if ranks.is_coordinator:
            step_dir = str(resolve_step_dir(path_or_root))
        for target in targets:
            target.validate()
        replicas.check(ranks.ranks)
    except CheckpointError as exc:
        error = exc
    # Without local files there is no page cache to share: every rank is its own.
    cache = (page_cache_id() if storage_for(as_path(path_or_root)).local_files
             else f"rank {ranks.rank}")
    infos = [t.info() for t in targets]
    shares, peers, pieces = _carries_cpu(group), None, []
    if shares and (replicas.sharing or replicas.disjoint):
        step_dir = ranks.announce(step_dir, error, what, replicas.fingerprint)
        members = replicas.of(ranks.rank)[0]
        # a class of one (disjoint state, or a rank in no class) reads its own targets
        peers = (class_peers(ranks, members, replicas.split(infos)[0], cache)
                 if len(members) > 1 else ClassPeers(members, {ranks.rank: 0}))
    else:
        step_dir, pieces = plan_load(ranks, infos, cache, step_dir, what, error, shares)
    step_dir = as_path(step_dir)

    error, manifest, shared = None, None, None
    try:
        if peers is not None and peers.mismatch:
            raise CheckpointError(peers.mismatch)
        manifest = read_manifest(step_dir)
        check_targets(step_dir, manifest, targets)
        if peers is not None:
            pieces = class_load_pieces(ranks.rank, infos, manifest.tensors, peers, replicas)
        shared = SharedReads.build(ranks.rank, targets, pieces, group)
        read_boxes(step_dir, manifest, shared.reads, checked=True)
    except CheckpointError as exc:
        error = exc
    ranks.agree(error, f"checkpoint load from {step_dir}")
    shared.exchange()
    log.info("loaded %d shards from %s: read %d bytes, received %d, sent %d",
             len(targets), step_dir, shared.read_bytes, shared.received_bytes,
             shared.sent_bytes)
    return manifest


@dataclass(frozen=True)
class LoadRequest:
    """What a rank sends the owner of some of its tensors: its targets' boxes of them
    and its page cache. The coordinator sends the relays of the step directory all
    ranks load (``plan_load``): in its request where it has one for that rank, else
    alone (a string)."""

    infos: tuple[ShardInfo, ...]
    cache: str
    step_dir: str | None = None


@dataclass(frozen=True)
class ReadPiece:
    """One cell of the common refinement of a tensor's targets, as one holder gets it
    from the tensor's owner (or decides it with its replica class, ``class_pieces``):
    who reads it from storage, and (to that reader) the holders on other hosts it
    sends the cell to."""

    key: str
    box: Box
    reader: int
    send_to: tuple[int, ...] = ()


def plan_reads(requests: dict[int, LoadRequest]) -> dict[int, list[ReadPiece]]:
    """An owner's plan of its tensors: their targets (``requests``, by rank) cut into
    the cells of their common refinement, each read from storage by one holder (largest
    first, to the holder that reads the fewest bytes so far, as writers are chosen),
    and each holder's pieces. Holders sharing the reader's page cache read the cell
    themselves (the kernel serves them from the reader's pages); the others receive it."""
    infos = {r: list(q.infos) for r, q in requests.items() if q.infos}
    caches = {r: q.cache for r, q in requests.items()}
    dtypes = {i.key: i.dtype for rank_infos in infos.values() for i in rank_infos}
    units = [WriteUnit(c.key, c.box, c.holders, c.box.numel * DTYPE_ITEMSIZE[dtypes[c.key]])
             for c in common_refinement(infos)]
    pieces: dict[int, list[ReadPiece]] = {}
    for unit in assign_writers(units):
        away = tuple(p for p in unit.holders if caches[p] != caches[unit.writer])
        for holder in unit.holders:
            reader = holder if caches[holder] == caches[unit.writer] else unit.writer
            pieces.setdefault(holder, []).append(ReadPiece(
                unit.key, unit.box, reader, away if holder == unit.writer else ()))
    return pieces


def relay_block(count: int) -> int:
    """How many ranks one relay of the step directory serves in a group of ``count``:
    about the square root, so that neither the coordinator (one message to each relay)
    nor a relay (one to each rank of its block) sends to more than that many."""
    return math.isqrt(max(0, count - 1)) + 1


def to_relays(outgoing: dict[int, "LoadRequest | str"], ranks: Sequence[int],
              step_dir: str | None) -> dict[int, "LoadRequest | str"]:
    """The coordinator's requests with the step directory added for the first rank of
    each block (``relay_block``): in its request where it has one for that rank, else
    alone (a string, the bare path)."""
    out = dict(outgoing)
    for relay in ranks[::relay_block(len(ranks))]:
        out[relay] = (dataclasses.replace(out[relay], step_dir=step_dir) if relay in out
                      else step_dir)
    return out


def replies(owned: dict[int, list["ReadPiece"]], ranks: Sequence[int], position: int,
            step_dir: str | None) -> dict[int, tuple[list["ReadPiece"], str | None]]:
    """An owner's pieces for each holder (``plan_reads``), and from a relay (the rank
    at ``position`` of ``ranks`` first in its block) the step directory, where it
    relays one, to the other ranks of its block."""
    out: dict[int, tuple[list[ReadPiece], str | None]] = {
        rank: (pieces, None) for rank, pieces in owned.items()}
    block = relay_block(len(ranks))
    if step_dir is not None and not position % block:
        for rank in ranks[position + 1:position + block]:
            out[rank] = (out.get(rank, ([], None))[0], step_dir)
    return out


def plan_load(ranks: comm.Comm, infos: Sequence[ShardInfo], cache: str,
              step_dir: str | None, what: str, error: BaseException | None = None,
              shares: bool = True) -> tuple[str, list[ReadPiece]]:
    """The owners' plan of a load without replica classes (or on a group that carries
    no CPU tensors: NCCL), two sparse exchanges: the coordinator's ``step_dir`` to the
    first rank of each block of ``relay_block`` ranks and, where the group carries the
    bytes (``shares``), every rank's targets to the owners of their tensors; then each
    holder's pieces back from the owners, and the step directory from the first rank
    of its block (the coordinator sending it to every rank sent 1 MB, one message per
    rank, at 16,016 ranks). Without ``shares`` each rank plans its own targets alone.
    Returns the step directory and this rank's pieces."""
    position, block = ranks.ranks.index(ranks.rank), relay_block(len(ranks.ranks))
    outgoing: dict[int, LoadRequest | str] = {}
    if shares:
        outgoing = {owner: LoadRequest(tuple(mine), cache)
                    for owner, mine in route(infos, ranks.ranks).items()}
    if ranks.is_coordinator:
        outgoing = to_relays(outgoing, ranks.ranks, step_dir)
    received = ranks.exchange(outgoing, what, error)
    if not position % block:
        picked = received[ranks.coordinator]
        step_dir = picked if isinstance(picked, str) else picked.step_dir
    owned, error = {}, None
    try:
        owned = plan_reads({r: q for r, q in received.items() if isinstance(q, LoadRequest)})
    except ValueError as exc:  # targets that disagree on a tensor's global shape
        error = CheckpointError(f"targets disagree: {exc}")
    received = ranks.exchange(replies(owned, ranks.ranks, position, step_dir), what, error)
    if position % block:
        step_dir = received[ranks.ranks[position - position % block]][1]
    pieces = [p for part, _ in received.values() for p in part] if shares else plan_reads(
        {ranks.rank: LoadRequest(tuple(infos), cache)}).get(ranks.rank, [])
    return step_dir, pieces


@dataclass(frozen=True)
class ClassPeers:
    """What a member of a replica class knows of its class before its reads: the
    members, each one's page cache (``_name`` of it), and whether any member's
    targets differ from this rank's (``mismatch``: then the load fails)."""

    members: tuple[int, ...]
    caches: dict[int, int]
    mismatch: str | None = None


def _name(text: str) -> int:
    """A 63-bit name of ``text``, the same in every process."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def peer_names(infos: Sequence[ShardInfo], cache: str) -> list[int]:
    """What a member tells the others of its class: a 63-bit name of its targets
    (keys, global shapes, boxes, dtypes) and of its page cache."""
    return [_name(repr(sorted((i.key, tuple(i.global_shape), i.box.offset, i.box.shape,
                               i.dtype) for i in infos))), _name(cache)]


def class_peers(ranks: comm.Comm, members: tuple[int, ...], infos: Sequence[ShardInfo],
                cache: str) -> ClassPeers:
    """This rank's ``peer_names`` sent to every other member of its replica class and
    theirs received (``Comm.swap``: 16 bytes each way per member): the members split
    their reads on the promise that their targets are the same, so a class whose
    members' targets differ is found here, before anything is read or sent."""
    mine = peer_names(infos, cache)
    heard = ranks.swap([m for m in members if m != ranks.rank], mine)
    return peers_of(ranks.rank, members, {**heard, ranks.rank: mine})


def peers_of(rank: int, members: tuple[int, ...], heard: dict[int, list[int]]) -> ClassPeers:
    """``rank``'s view of its class from every member's ``peer_names``."""
    differ = [m for m in members if heard[m][0] != heard[rank][0]]
    mismatch = (f"replica class {list(members[:8])}: rank(s) {differ[:8]} hold other "
                f"targets than rank {rank}; a class's members must hold the same boxes "
                f"of the same tensors (build the classes from the layout, "
                f"parallel.shards.replica_classes, or pass none)") if differ else None
    return ClassPeers(members, {m: heard[m][1] for m in members}, mismatch)


def class_pieces(rank: int, infos: Sequence[ShardInfo], entries: dict[str, TensorEntry],
                 peers: ClassPeers) -> list[ReadPiece]:
    """A member's pieces of its class's load, decided by every member alike from its
    own targets (the same as the others', ``class_peers``) and the step's file grids,
    with no message: the targets' cells (``common_refinement`` of this rank's own
    boxes) cut along the files, each read by one member (largest first, to the member
    that reads the fewest bytes so far), who sends it to the members on other page
    caches; members sharing the reader's page cache read it themselves. Storage serves
    each byte once per class that holds it (per class and page cache: never more than
    the class's members). A class of one reads its cells whole: there is no one to
    share them with."""
    members, caches = peers.members, peers.caches
    units = [(cell.key, box, box.numel * DTYPE_ITEMSIZE[entries[cell.key].dtype])
             for cell in common_refinement({rank: infos})
             for box in (grid_cut(cell.box, entries[cell.key].shard) if len(members) > 1
                         else [cell.box])]
    units.sort(key=lambda u: (-u[2], u[0], u[1].offset))
    loads = [(0, index) for index in range(len(members))]
    pieces = []
    for key, box, nbytes in units:
        load, index = heapq.heappop(loads)
        heapq.heappush(loads, (load + nbytes, index))
        reader = members[index]
        if caches[reader] != caches[rank]:
            pieces.append(ReadPiece(key, box, reader))
            continue
        away = tuple(m for m in members if caches[m] != caches[rank]) if reader == rank else ()
        pieces.append(ReadPiece(key, box, rank, away))
    return pieces


def class_load_pieces(rank: int, infos: Sequence[ShardInfo], entries: dict[str, TensorEntry],
                      peers: ClassPeers, replicas: Replicas) -> list[ReadPiece]:
    """A rank's pieces of a load with replica classes (or disjoint state): its class's
    split of the targets its members share (``class_pieces``), and its own reads of
    those it holds alone (``Replicas.split``: the grid's tensors of mixed state)."""
    shared, alone = replicas.split(infos)
    return (class_pieces(rank, shared, entries, peers)
            + class_pieces(rank, alone, entries, ClassPeers((rank,), {rank: 0})))


@dataclass
class _Piece:
    """One cell of the common refinement as this rank holds it: the views of every
    local target containing it (the first is filled, the others copy it)."""

    target: LocalShard
    """The cell as a read target: a view of the first local target containing it."""
    copies: list[torch.Tensor]
    reader: int


class SharedReads:
    """Who reads which bytes of a collective load, so storage serves each byte once.

    The targets of each tensor are cut into the cells of their common refinement (by
    the tensor's owner, ``plan_reads``; within a replica class, by every member alike,
    ``class_pieces``); a cell held by several ranks is read from storage by one of
    them (largest first, to the holder that reads the fewest bytes so far, as the
    writer's plan assigns writers). Holders that share its reader's page cache (one
    kernel: the same host) read it themselves: the kernel serves their reads from the
    pages the first read brought in, so storage still serves the bytes once, and a read
    from the page cache costs less than a message (measured: a same-layout load of two
    data-parallel replicas on one host took twice as long exchanging over gloo). Holders
    on other hosts, and every holder on object storage, receive the cell from its
    reader: one message per pair of ranks, the cells packed in plan order. Needs a
    group whose backend carries CPU tensors (gloo); under any other backend every rank
    reads all it needs.
    """

    def __init__(self, rank: int, pieces: list[_Piece], sends: dict[int, list[torch.Tensor]],
                 group) -> None:
        self.rank, self.group = rank, group
        self.pieces, self.sends = pieces, sends
        self.reads = [p.target for p in pieces if p.reader == rank]
        self.read_bytes = sum(_nbytes(t.data) for t in self.reads)
        self.received_bytes = sum(_nbytes(p.target.data) for p in pieces if p.reader != rank)
        self.sent_bytes = sum(_nbytes(v) for views in sends.values() for v in views)

    @staticmethod
    def build(rank: int, targets: Sequence[LocalShard], pieces: Sequence[ReadPiece],
              group=None) -> "SharedReads":
        """This rank's reads, receives and sends from its pieces (``plan_reads``), in
        the one order every pair of ranks packs and unpacks them: by key, then
        offset."""
        by_key: dict[str, list[LocalShard]] = {}
        for target in targets:
            by_key.setdefault(target.key, []).append(target)
        out, sends = [], {}
        for piece in sorted(pieces, key=lambda p: (p.key, p.box.offset)):
            held = by_key[piece.key]
            views = [local_view(t.data.detach(), t.box, piece.box) for t in held
                     if t.box.contains(piece.box)]
            out.append(_Piece(LocalShard(piece.key, held[0].global_shape, piece.box.offset,
                                         views[0]), views[1:], piece.reader))
            for peer in piece.send_to:
                sends.setdefault(peer, []).append(views[0])
        return SharedReads(rank, out, sends, group)

    def exchange(self) -> None:
        """Send what this rank read to the other holders, receive the rest, then fill
        each rank's local duplicates. Collective: every rank calls it after its reads."""
        receives: dict[int, list[torch.Tensor]] = {}
        for piece in self.pieces:
            if piece.reader != self.rank:
                receives.setdefault(piece.reader, []).append(piece.target.data)
        if self.sends or receives:
            import torch.distributed as dist

            ops, inbox = [], {}
            for peer, views in sorted(self.sends.items()):
                packed = torch.empty(sum(_nbytes(v) for v in views), dtype=torch.uint8)
                for flat, view in _packed_slices(packed, views):
                    _copy(flat, view)
                ops.append(dist.P2POp(dist.isend, packed, peer, self.group))
            for peer, views in sorted(receives.items()):
                inbox[peer] = torch.empty(sum(_nbytes(v) for v in views), dtype=torch.uint8)
                ops.append(dist.P2POp(dist.irecv, inbox[peer], peer, self.group))
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            for peer, views in receives.items():
                for flat, view in _packed_slices(inbox[peer], views):
                    _copy(view, flat)
        for piece in self.pieces:
            for copy in piece.copies:
                _copy(copy, piece.target.data)


def page_cache_id() -> str:
    """What identifies this process's page cache: the running kernel's boot id (one per
    host, shared by its containers), else the host name."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def _copy(dest: torch.Tensor, source: torch.Tensor) -> None:
    """``dest[...] = source`` on one thread (numpy): many small copies through torch's
    intra-op threads spin on a loaded host."""
    np.copyto(numpy_view(dest), numpy_view(source))


def _carries_cpu(group) -> bool:
    import torch.distributed as dist

    return (dist.is_available() and dist.is_initialized()
            and "gloo" in str(dist.get_backend(group)))


def _nbytes(view: torch.Tensor) -> int:
    return view.numel() * view.element_size()


def _packed_slices(packed: torch.Tensor, views: list[torch.Tensor]):
    """Pairs of (slice of the flat byte buffer ``packed``, as the view's dtype and
    shape; the view), the views laid out one after another."""
    start = 0
    for view in views:
        n = _nbytes(view)
        yield packed[start:start + n].view(view.dtype).view(view.shape), view
        start += n


def check_targets(step_dir: Location, manifest: Manifest, targets: Sequence[LocalShard]) -> None:
    """Raise ``CheckpointError`` naming the tensor when a target does not fit the step."""
    for target in targets:
        entry = _entry(manifest, target.key, step_dir)
        if tuple(target.global_shape) != entry.shape:
            raise CheckpointError(
                f"tensor {target.key}: the run expects global shape "
                f"{tuple(target.global_shape)}, {step_dir} has {entry.shape}; the model "
                f"config differs from the checkpoint's")
        if target.dtype != entry.dtype:
            raise CheckpointError(
                f"tensor {target.key}: the run holds {target.dtype}, {step_dir} stores "
                f"{entry.dtype}; load into a {entry.dtype} tensor and convert")
        target.validate()


def read_boxes(step_dir: Location, manifest: Manifest,
               targets: Sequence[LocalShard], *, fast: bool = True,
               checked: bool = False) -> None:
    """Fill every target's ``data`` with its box: through ``fast_read`` where it
    handles the tensor (and ``fast``; local files only), else one batched TensorStore
    read per target; all of it again after a transient storage error (``retrying``).
    ``checked``: ``check_targets`` has passed already."""
    if not checked:
        check_targets(step_dir, manifest, targets)
    retrying(lambda: _read_boxes(step_dir, manifest, targets, fast), f"reading {step_dir}")


def _read_boxes(step_dir: Location, manifest: Manifest, targets: Sequence[LocalShard],
                fast: bool) -> None:
    direct: list[LocalShard] = []
    rest: list[LocalShard] = []
    storage = storage_for(step_dir)
    for target in targets:
        handled = (fast and storage.local_files
                   and fast_read.handles(manifest.tensors[target.key], target))
        (direct if handled else rest).append(target)
    if direct:
        fast_read.read_targets(storage.local_path(step_dir), manifest.tensors, direct,
                               missing_is_damage=manifest.every_chunk_stored)
    if not rest:
        return
    keys = {t.key for t in rest}
    arrays = open_arrays(step_dir, {k: manifest.tensors[k] for k in keys}, create=False,
                         fill_missing=not manifest.every_chunk_stored)
    futures = []
    with ts.Batch() as batch:
        for target in rest:
            dest = ts.array(numpy_view(target.data), copy=False, write=True)
            source = arrays[target.key][target.box.slices()]
            futures.append((target.key, dest.write(source, batch=batch).commit))
    wait_all(futures, f"read from {step_dir}")


def _entry(manifest: Manifest, key: str, step_dir: Location) -> TensorEntry:
    try:
        return manifest.tensors[key]
    except KeyError:
        near = [k for k in manifest.tensors if k.split(".")[-1] == key.split(".")[-1]][:3]
        raise CheckpointError(
            f"tensor {key} is not in {step_dir} ({len(manifest.tensors)} tensors"
            + (f", e.g. {near}" if near else "") + "); the model or state naming differs "
            "from the checkpoint's") from None
