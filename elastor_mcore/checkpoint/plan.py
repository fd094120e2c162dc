"""Who writes what: turn every rank's shards into write units, each written once.

A write unit is one file (outer chunk) of one tensor; files never straddle a cell of
the common refinement of the tensor's shards, so each has a fixed set of holders and
exactly one writer. Nothing about one tensor depends on another's shards, so each
tensor is planned by one rank, its *owner* (``owner_of``), from the shards of the
ranks that hold it, as DCP plans: each rank's local plan (``route``: its shard
descriptions, by owner), the owners' global plan of their tensors (``build_plan``),
and each rank's part of it (``assignments``, ``merge``). A rank's work and messages
follow the tensors it holds and owns, not the size of the job.

Data-parallel replicas hold the same boxes, so an owner hearing from every holder
would hear the same boxes from each replica (728 holders of each tensor of Llama 3
405B on 16,384 GPUs). Where the caller says which ranks hold the same shards
(``Replicas``, from the layout every rank knows), each tensor is planned in
``Replicas.columns`` *columns*: the owner of a column hears from one member of each
class and tells a share of each class its part, expressed per class (where the class
starts in a cell's holder set; each member adds its own index), so an owner's work
follows the distinct boxes of its tensors, not their copies. Every column computes
the same plan, and each member checks that the cells it is told tile its own shards
(``uncovered``), so a wrong claim fails the save instead of writing a wrong file.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import heapq
import itertools
import math
import zlib
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch

from elastor_mcore.checkpoint.format import (
    DTYPE_ITEMSIZE, CheckpointError, ChunkPolicy, TensorEntry, choose_entry, validate_key)
from elastor_mcore.geometry import Box, Cell, ShardInfo, boundaries, common_refinement, grid_cut


@dataclass
class LocalShard:
    """What this rank holds of one global tensor: a view (any strides) of its box."""

    key: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    data: torch.Tensor

    @property
    def box(self) -> Box:
        return Box(tuple(self.global_offset), tuple(self.data.shape))

    @property
    def dtype(self) -> str:
        return str(self.data.dtype).removeprefix("torch.")

    def info(self) -> ShardInfo:
        return ShardInfo(self.key, tuple(self.global_shape), self.box, self.dtype)

    def validate(self) -> None:
        """Raise ``CheckpointError`` naming the key when the shard cannot be stored."""
        validate_key(self.key)
        if self.dtype not in DTYPE_ITEMSIZE:
            raise CheckpointError(f"tensor {self.key}: dtype {self.dtype} is not storable; "
                                  f"use one of {sorted(DTYPE_ITEMSIZE)}")
        shape, offset = tuple(self.global_shape), tuple(self.global_offset)
        if len(offset) != len(shape) or self.data.dim() != len(shape):
            raise CheckpointError(
                f"tensor {self.key}: global_shape {shape}, global_offset {offset} and "
                f"data shape {tuple(self.data.shape)} must have the same number of dims")
        if not Box((0,) * len(shape), shape).contains(self.box):
            raise CheckpointError(
                f"tensor {self.key}: box at {offset} of shape {tuple(self.data.shape)} "
                f"lies outside the global shape {shape}")


@dataclass(frozen=True)
class WriteUnit:
    """One file's worth of one tensor, with the ranks that hold it and its writer."""

    key: str
    box: Box
    holders: tuple[int, ...]
    nbytes: int
    writer: int = -1


@dataclass
class WritePlan:
    """A plan as one rank knows it. From ``build_plan`` (every tensor in one process):
    every unit, with its writer. On a rank of a save (``merge``): the units it writes
    (their holders unknown to it: ``()``), the entries of the arrays it holds (every
    entry on the coordinator), and as an owner its tensors' units, without writers."""

    entries: dict[str, TensorEntry]
    units: list[WriteUnit]
    creates: tuple[str, ...] = ()
    """Arrays whose metadata this rank creates (``metadata_creators``)."""
    owned: tuple[WriteUnit, ...] = ()
    """Every unit of the tensors this rank planned as their owner (of column 0,
    ``merge``), where its plan was asked for them (``plan_owned(units=True)``)."""
    mismatch: str | None = None
    """Why the cells this rank was told do not tile its shards (``uncovered``): its
    part of the save fails, and so the save."""
    files: tuple[str, ...] = ()
    """The named files (beside the arrays) this rank writes: each chosen by its owner
    among the ranks that offered it (``plan_owned``)."""

    def bytes_by_rank(self) -> dict[int, int]:
        """Bytes written per rank: every holder of a unit (0 if it writes none), and
        each writer (a rank's own plan knows no holders: ``merge``)."""
        load: dict[int, int] = {}
        for unit in self.units:
            for rank in unit.holders:
                load.setdefault(rank, 0)
            load[unit.writer] = load.get(unit.writer, 0) + unit.nbytes
        return load

    def units_of(self, rank: int) -> list[WriteUnit]:
        return [u for u in self.units if u.writer == rank]

    def created_entries(self) -> dict[str, TensorEntry]:
        """The entries of the arrays whose metadata this rank creates (``creates``)."""
        return {key: self.entries[key] for key in self.creates}

    def joined(self, other: "WritePlan") -> "WritePlan":
        """This plan and ``other``'s, of other tensors, as one: a save of mixed state
        (``Replicas.grid`` with classes) joins the replicated tensors' plan and this
        rank's plan of its disjoint ones."""
        return WritePlan(dict(sorted({**self.entries, **other.entries}.items())),
                         sorted([*self.units, *other.units],
                                key=lambda u: (u.key, u.box.offset)),
                         tuple(sorted({*self.creates, *other.creates})),
                         (*self.owned, *other.owned), self.mismatch or other.mismatch,
                         tuple(sorted({*self.files, *other.files})))


def merge_entries(parts: Iterable[Mapping[str, TensorEntry]]) -> dict[str, TensorEntry]:
    """The manifest's entries, sorted by key, from the ranks' parts (a disjoint save's
    coordinator hears each array's from the rank that creates it)."""
    return dict(sorted(itertools.chain.from_iterable(part.items() for part in parts)))


def assign_writers(units: Sequence[WriteUnit]) -> list[WriteUnit]:
    """Give each unit one writer among its holders, balancing bytes per rank.

    Units with a single holder are forced; the rest go, largest first, to the
    least-loaded holder. Ties go to the holders in an order rotated by a hash of the
    tensor's key, so owners that plan their tensors independently do not all start
    on the lowest rank. Deterministic for a given input order.
    """
    load: dict[int, int] = {r: 0 for u in units for r in u.holders}
    writer: dict[int, int] = {}
    for i, unit in enumerate(units):
        if len(unit.holders) == 1:
            writer[i] = unit.holders[0]
            load[unit.holders[0]] += unit.nbytes
    shared = sorted((i for i, u in enumerate(units) if len(u.holders) > 1),
                    key=lambda i: -units[i].nbytes)
    for i in shared:
        holders = units[i].holders
        turn = _key_hash(units[i].key) % len(holders)
        rank = min(holders, key=lambda r: (load[r], (holders.index(r) - turn) % len(holders)))
        writer[i] = rank
        load[rank] += units[i].nbytes
    return [WriteUnit(u.key, u.box, u.holders, u.nbytes, writer[i])
            for i, u in enumerate(units)]


def _key_hash(key: str) -> int:
    """Stable across processes (Python's ``hash`` of a string is not)."""
    return zlib.crc32(key.encode())


@dataclass(frozen=True)
class Replicas:
    """Classes of ranks that hold the same shards (the same keys, boxes and dtypes):
    a layout's data-parallel replicas of one stage and TP rank, where the optimizer
    state is not sharded over them. Ranks in no class are classes of their own (list
    them as classes of one, as ``parallel.shards.replica_classes`` does, for the
    columns to count them); with no class of two or more each tensor has one owner
    (one column).

    A class of ``n`` members takes part in ``min(n, columns)`` columns: its member
    ``i`` of the first ones sends its shards to the owners of the columns ``j`` with
    ``j % min(n, columns) == i``, and every member hears from the column after its own
    (``column``), whose shards another member sent: a member whose shards differ
    from its class's finds that the cells it is told do not tile its shards. A class
    of one sends its shards to every column's owner (each must hear every distinct
    box) and is told its part by column 0: where there is one, the columns are fewer
    (``columns``).

    ``disjoint``: no two ranks hold the same bytes (ZeRO-1's state, each element's
    optimizer state on one rank): a load's ranks each read their own targets from
    storage, with no owner planning their reads (a load stays right if some bytes are
    shared after all: storage then serves them once per rank that holds them).

    ``grid``: per tensor this rank holds that no two ranks hold the same bytes of, the
    cut points along each dim (0 and the extent included) of the boxes its layout
    holds it in unsharded, the same on every rank that holds it. Each rank writes its
    own shards of these tensors in the files ``format.choose_entry`` gives for these
    cuts, which its shards must be unions of (ZeRO-1 cuts its segments there:
    ``runtime.distributed_optimizer.file_rows``), and reads its own targets of them,
    no owner planning either (``plan_disjoint``). With ``disjoint`` every tensor is in
    the grid and a save plans nothing across ranks; with ``classes`` (mixed state:
    Megatron-LM's model weights replicated over the classes beside ZeRO-1's optimizer
    state) the tensors outside the grid are planned over the classes."""

    classes: tuple[tuple[int, ...], ...] = ()
    disjoint: bool = False
    grid: Mapping[str, Sequence[Sequence[int]]] | None = None

    def __post_init__(self) -> None:
        if self.disjoint and self.classes:
            raise CheckpointError(
                "replicas: disjoint state has no replica classes; pass either the "
                "classes (replicated state, with a grid of the disjoint tensors where "
                "some are) or disjoint=True (ZeRO-1), not both")
        if self.grid is not None and not (self.disjoint or self.classes):
            raise CheckpointError(
                "replicas: a grid names disjoint tensors; pass disjoint=True with it "
                "(all the state disjoint) or the replica classes of the other tensors")
        seen: set[int] = set()
        for members in self.classes:
            if not members or list(members) != sorted(set(members)) or seen & set(members):
                raise CheckpointError(
                    f"replica class {members[:8]}: each class must be a non-empty, sorted "
                    f"tuple of distinct ranks, no rank in two classes")
            seen.update(members)

    @functools.cached_property
    def _index(self) -> dict[int, tuple[tuple[int, ...], int]]:
        return {rank: (members, i) for members in self.classes
                for i, rank in enumerate(members)}

    @functools.cached_property
    def columns(self) -> int:
        """How many owners plan each tensor, each telling a share of every class (not
        all of it): the smallest size ``m`` of a class of two or more (1 with none).
        A class of one sends its shards to every column's owner, so where one is
        listed the columns are ``ceil(sqrt(m))``: the copies it sends and the members
        of a class an owner tells, each about the square root of ``m``, where ``m``
        columns had it send ``m`` copies (12.5 MB for Llama 3 8B's save at 4,096 GPUs
        after 1 lost) and one column had an owner tell every member (2.7 MB)."""
        sizes = [len(c) for c in self.classes if len(c) > 1]
        smallest = min(sizes, default=1)
        return math.isqrt(smallest - 1) + 1 if len(sizes) < len(self.classes) else smallest

    @functools.cached_property
    def fingerprint(self) -> int:
        """A 20-bit name of the classes (or of ``disjoint``), the same in every process:
        a load checks that every rank passed the same ones (``comm.Comm.announce``)."""
        text = "disjoint" if self.disjoint else repr((self.classes, self.grid is not None))
        digest = hashlib.blake2b(text.encode(), digest_size=4).digest()
        return int.from_bytes(digest, "little") >> 12

    @functools.cached_property
    def sharing(self) -> int:
        """How many ranks are in a class of two or more: a load with none plans
        through the tensors' owners; with some, the other ranks (classes of their own)
        read their own targets."""
        return sum(len(members) for members in self.classes if len(members) > 1)

    def split(self, infos: Sequence[ShardInfo]) -> tuple[list[ShardInfo], list[ShardInfo]]:
        """``infos`` as (those the classes share, those this rank holds alone: all of
        them with ``disjoint``, else the grid's)."""
        if self.disjoint:
            return [], list(infos)
        grid = self.grid or {}
        return ([i for i in infos if i.key not in grid], [i for i in infos if i.key in grid])

    def check(self, ranks: Sequence[int]) -> None:
        """Raise ``CheckpointError`` naming a class member outside the group."""
        outside = set(self._index) - set(ranks)
        if outside:
            raise CheckpointError(
                f"replica classes name rank(s) {sorted(outside)[:8]} outside the group of "
                f"the save or load; build the classes from the group's own layout")

    def of(self, rank: int) -> tuple[tuple[int, ...], int]:
        """``rank``'s class and its index in it."""
        return self._index.get(rank, ((rank,), 0))

    def _share(self, members: tuple[int, ...]) -> int:
        return min(len(members), self.columns)

    def sends(self, rank: int) -> range:
        """The columns whose owners ``rank`` sends its shards to (none for a member
        past the class's first ``columns``)."""
        members, i = self.of(rank)
        share = self._share(members)
        return range(i, self.columns, share) if i < share else range(0)

    def column(self, rank: int) -> int:
        """The column whose owner tells ``rank`` its part."""
        members, i = self.of(rank)
        return (i + 1) % self._share(members)

    def told(self, members: tuple[int, ...], column: int) -> tuple[int, ...]:
        """The members of a class that the owner of ``column`` tells their part."""
        share = self._share(members)
        return members[(column - 1) % share::share] if column < share else ()


NO_REPLICAS = Replicas()


def owner_of(key: str, ranks: Sequence[int], column: int = 0, columns: int = 1) -> int:
    """The rank of ``ranks`` that plans column ``column`` of tensor ``key``: column
    ``j`` of every tensor is planned in the ``j``-th of ``columns`` slices of
    ``ranks``, spread over it by a hash of the key, so a job's tensors spread over its
    ranks and each rank owns few, and the coordinator hears the entries (column 0)
    from one slice's ranks, not from as many ranks as there are tensors."""
    width = max(1, len(ranks) // columns)
    return ranks[column * width + _key_hash(key) % width]


def column_of(position: int, count: int, columns: int) -> int:
    """The column that the rank at ``position`` of ``count`` ranks owns tensors of
    (``owner_of`` backwards)."""
    return position // max(1, count // columns)


def route(infos: Iterable[ShardInfo], ranks: Sequence[int], columns: Iterable[int] = (0,),
          count: int = 1) -> dict[int, list[ShardInfo]]:
    """A rank's local plan: its shard descriptions, by the owner of each column
    ``columns`` (of ``count``) of each tensor (a save sends ``held_bytes`` with them)."""
    out: dict[int, list[ShardInfo]] = {}
    for info in infos:
        for column in columns:
            out.setdefault(owner_of(info.key, ranks, column, count), []).append(info)
    return out


def plan_tensors(infos_by_rank: dict[int, Sequence[ShardInfo]],
                 policy: ChunkPolicy) -> tuple[dict[str, TensorEntry], list[Cell]]:
    """Index entries and cells of the tensors in ``infos_by_rank`` (each rank's shards
    of them): an owner's global plan of its tensors. Each cell is cut into files by
    its entry's file grid (``file_units``)."""
    dtypes: dict[str, str] = {}
    boxes: dict[str, list[Box]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for rank in sorted(infos_by_rank):
        for info in infos_by_rank[rank]:
            if dtypes.setdefault(info.key, info.dtype) != info.dtype:
                raise CheckpointError(
                    f"tensor {info.key}: ranks hold it as {dtypes[info.key]} and "
                    f"{info.dtype} (rank {rank}); every replica must have one dtype")
            shapes[info.key] = info.global_shape
            boxes.setdefault(info.key, []).append(info.box)
    try:
        cells = common_refinement(infos_by_rank)
    except ValueError as exc:
        raise CheckpointError(f"shards disagree: {exc}") from exc
    entries = {key: choose_entry(shapes[key], dtypes[key], boundaries(shapes[key], boxes[key]),
                                 policy) for key in sorted(shapes)}
    covered = dict.fromkeys(entries, 0)
    for cell in cells:
        covered[cell.key] += cell.box.numel
    missing = [k for k, n in covered.items() if n != math.prod(entries[k].shape)]
    if missing:
        raise CheckpointError(
            f"no rank holds part of tensor(s) {missing[:5]}: the saving ranks' shards must "
            f"cover every global tensor")
    return entries, cells


def file_units(entries: dict[str, TensorEntry], cells: Iterable[Cell]) -> list[WriteUnit]:
    """The cells cut into files (without writers)."""
    return [WriteUnit(cell.key, box, cell.holders,
                      box.numel * DTYPE_ITEMSIZE[entries[cell.key].dtype])
            for cell in cells for box in grid_cut(cell.box, entries[cell.key].shard)]


@dataclass(frozen=True)
class Held:
    """A cell, or one of its files, as one of its holders learns it from the tensor's
    owner (one per cell: the holder cuts it into files itself, ``files_of``): which
    holder set it belongs to (``group``, a hash of its classes, and its number of
    ranks), where this holder stands in it, and how many bytes each member holds in
    all (``weights``: runs of ``(bytes, members)`` in position order), but not the
    ranks themselves (a set may span the job). From an owner, ``position`` is where
    the holder's class starts in the set; ``merge`` adds the holder's index in it."""

    key: str
    box: Box
    nbytes: int
    group: int
    holders: int
    position: int
    weights: tuple[tuple[int, int], ...]


def holder_group(signature: Sequence[tuple[int, int]]) -> int:
    """A 64-bit name of a holder set, the same in every process, from its classes
    (first member, members holding) in position order."""
    data = b"".join(n.to_bytes(4, "little") for pair in signature for n in pair)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def writer_positions(units: Sequence[Held]) -> list[int]:
    """The writer of each unit, as a position in its holder set: the units of one set
    go, largest first, to the member whose bytes written so far, times the bytes it
    holds in all, are the least (ties rotated by the set's name, so one rank is not
    everyone's first choice). Weighting by what a member holds makes a rank that
    holds more (a longer stage of a heterogeneous layout) write less of each set it
    shares, as one plan of the whole job balancing every rank would. Each holder of a
    set holds every unit of the set, so all of them compute the same writers from
    their own units, with no further message."""
    order = sorted(range(len(units)), key=lambda i: (
        units[i].group, -units[i].nbytes, units[i].key, units[i].box.offset))
    heaps: dict[int, list[tuple[int, int, int, int, int]]] = {}
    out = [0] * len(units)
    for i in order:
        unit = units[i]
        heap = heaps.get(unit.group)
        if heap is None:
            turn = unit.group % unit.holders
            weights = [max(1, w) for w, n in unit.weights for _ in range(n)]
            heap = heaps[unit.group] = [(0, (p - turn) % unit.holders, p, 0, weights[p])
                                        for p in range(unit.holders)]
            heapq.heapify(heap)
        _, tie, position, load, weight = heapq.heappop(heap)
        load += unit.nbytes
        heapq.heappush(heap, (load * weight, tie, position, load, weight))
        out[i] = position
    return out


def _runs(weights: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """``(bytes, members)`` pairs with equal neighbours merged."""
    runs: list[list[int]] = []
    for weight, count in weights:
        if runs and runs[-1][0] == weight:
            runs[-1][1] += count
        else:
            runs.append([weight, count])
    return tuple((w, n) for w, n in runs)


def held_cells(cells: Iterable[Cell], held_bytes: dict[int, int],
               replicas: Replicas = NO_REPLICAS) -> dict[int, list[Held]]:
    """Each holder's view of ``cells`` (an owner's, from the shards it heard), each
    holder standing for its class: the set's classes in order of their first member,
    ``position`` where the holder's class starts, every member weighted by what the
    holder holds in all (``held_bytes``)."""
    out: dict[int, list[Held]] = {}
    views: dict[tuple[int, ...], list[tuple[int, Held]]] = {}
    for cell in cells:
        view = views.get(cell.holders)
        if view is None:
            classes = sorted((replicas.of(rank)[0], rank) for rank in cell.holders)
            signature = [(members[0], len(members)) for members, _ in classes]
            group, total = holder_group(signature), sum(n for _, n in signature)
            weights = _runs((held_bytes[rank], len(members)) for members, rank in classes)
            starts = itertools.accumulate([0] + [n for _, n in signature])
            view = views[cell.holders] = [
                (rank, Held("", Box((), ()), 0, group, total, start, weights))
                for (_, rank), start in zip(classes, starts)]
        for rank, held in view:
            out.setdefault(rank, []).append(dataclasses.replace(held, key=cell.key,
                                                                box=cell.box))
    return out


def files_of(cells: Iterable[Held], entries: dict[str, TensorEntry]) -> list[Held]:
    """Held cells cut into their files, by their entries' file grids."""
    return [dataclasses.replace(cell, box=box,
                                nbytes=box.numel * DTYPE_ITEMSIZE[entries[cell.key].dtype])
            for cell in cells for box in grid_cut(cell.box, entries[cell.key].shard)]


def held_bytes(infos: Iterable[ShardInfo]) -> int:
    """What a rank holds in all: the weight of its writes (``writer_positions``)."""
    return sum(info.box.numel * DTYPE_ITEMSIZE.get(info.dtype, 1) for info in infos)


def build_plan(infos_by_rank: dict[int, Sequence[ShardInfo]], policy: ChunkPolicy,
               replicas: Replicas = NO_REPLICAS) -> WritePlan:
    """The whole plan of the tensors in ``infos_by_rank``, in one process, from every
    holder's shards (what the ranks of a save compute between them, from one member
    of each class: ``plan_tensors`` by the owners, ``writer_positions`` by the
    holders): each cell's holders in order of their class (its first member), then
    of their index in it."""
    entries, cells = plan_tensors(infos_by_rank, policy)
    totals = {rank: held_bytes(infos) for rank, infos in infos_by_rank.items()}
    views: dict[tuple[int, ...], dict[int, Held]] = {}
    held: dict[int, list[Held]] = {}
    for cell in cells:
        view = views.get(cell.holders)
        if view is None:
            ordered = sorted(cell.holders,
                             key=lambda r: (replicas.of(r)[0][0], replicas.of(r)[1]))
            firsts = [replicas.of(rank)[0][0] for rank in ordered]
            group = holder_group([(f, firsts.count(f)) for f in dict.fromkeys(firsts)])
            weights = _runs((totals[rank], 1) for rank in ordered)
            view = views[cell.holders] = {
                rank: Held("", Box((), ()), 0, group, len(ordered), position, weights)
                for position, rank in enumerate(ordered)}
        for rank, template in view.items():
            held.setdefault(rank, []).append(dataclasses.replace(template, key=cell.key,
                                                                 box=cell.box))
    writers: dict[tuple[str, tuple[int, ...]], int] = {}
    for rank, mine in held.items():
        files = files_of(mine, entries)
        for unit, position in zip(files, writer_positions(files)):
            if position == unit.position:
                writers[unit.key, unit.box.offset] = rank
    units = [WriteUnit(u.key, u.box, u.holders, u.nbytes, writers[u.key, u.box.offset])
             for u in file_units(entries, cells)]
    plan = WritePlan(entries, units)
    plan.creates = tuple(sorted(metadata_creators(plan)))
    return plan


def plan_disjoint(rank: int, infos: Sequence[ShardInfo], policy: ChunkPolicy,
                  grid: Mapping[str, Sequence[Sequence[int]]]) -> WritePlan:
    """This rank's plan of a save of disjoint state (``Replicas.grid``), from its own
    shards alone: each tensor's entry from the grid's cuts (what an unsharded save of
    the layout chooses), every file of its shards its own to write, the metadata of
    the arrays whose first file it writes. ``WritePlan.mismatch`` says where a shard
    is not a union of its tensor's files (two ranks would write one file) or the grid
    lacks a tensor."""
    entries: dict[str, TensorEntry] = {}
    units: list[WriteUnit] = []
    mismatch = None
    for info in infos:
        cuts = grid.get(info.key)
        if cuts is None:
            mismatch = mismatch or (f"tensor {info.key}: not in the replicas' grid; build "
                                    f"it from the cells of every tensor this rank saves")
            continue
        entry = entries.setdefault(info.key, choose_entry(info.global_shape, info.dtype,
                                                          cuts, policy))
        if any(lo % s or (hi % s and hi != n) for lo, hi, s, n in zip(
                info.box.offset, info.box.end, entry.shard, entry.shape)):
            mismatch = mismatch or (
                f"tensor {info.key}: box {info.box} is not a union of its files "
                f"{entry.shard}; disjoint shards must be cut at the grid's file "
                f"boundaries")
        units += [WriteUnit(info.key, box, (), box.numel * DTYPE_ITEMSIZE[info.dtype], rank)
                  for box in grid_cut(info.box, entry.shard)]
    units.sort(key=lambda u: (u.key, u.box.offset))
    plan = WritePlan(dict(sorted(entries.items())), units, mismatch=mismatch)
    plan.creates = tuple(sorted(metadata_creators(plan)))
    return plan


DIGEST_BITS = 40
"""A save's file digests are sums modulo ``2**DIGEST_BITS``: a rank's fits an int64
``all_reduce`` of 16,384 ranks' with room to spare."""


def _file_hashes(key: str, indices: np.ndarray) -> int:
    """The sum of a 30-bit pseudo-random hash of each file ``indices`` (its place in
    the tensor's file grid, row-major) of tensor ``key``."""
    mixed = (indices.astype(np.uint64) * np.uint64(0x9E3779B1) + np.uint64(_key_hash(key)))
    return int(((mixed * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(34)).sum(dtype=np.uint64))


def written_digest(plan: WritePlan) -> int:
    """A name of the files this rank writes (``WritePlan.units``), summed over the ranks
    of a save and compared with ``expected_digest`` at the commit: a file written
    twice where another is missing leaves the count of files right, not the digest."""
    indices: dict[str, list[int]] = {}
    for unit in plan.units:
        entry = plan.entries[unit.key]
        grid = [-(-n // s) for n, s in zip(entry.shape, entry.shard)]
        place = [o // s for o, s in zip(unit.box.offset, entry.shard)]
        indices.setdefault(unit.key, []).append(
            int(np.ravel_multi_index(place, grid)) if grid else 0)
    return sum(_file_hashes(key, np.array(found)) for key, found in indices.items()) \
        % 2 ** DIGEST_BITS


def expected_digest(entries: Mapping[str, TensorEntry]) -> int:
    """``written_digest`` summed over the ranks of a save that writes every file of
    ``entries`` once."""
    return sum(_file_hashes(key, np.arange(entry.num_files))
               for key, entry in entries.items()) % 2 ** DIGEST_BITS


def metadata_creators(plan: WritePlan) -> dict[str, int]:
    """Per array, the rank that creates its metadata: the writer of its first file
    (the one at the origin), so ranks that write the same arrays share the work."""
    return {u.key: u.writer for u in plan.units if not any(u.box.offset)}


Request = tuple[int, Sequence[ShardInfo], Sequence[str], Mapping[str, TensorEntry]]
"""What a rank of a save sends an owner (its local plan, ``requests``): what it holds
in all (``held_bytes``, the weight of its writes), its shards of the owner's tensors,
the named files it offers to write whose owner this is (``owner_of`` each name) and,
to the coordinator only, the entries of the arrays it created alone (the disjoint
tensors of mixed state, ``plan_disjoint``)."""


def requests(rank: int, infos: Sequence[ShardInfo], ranks: Sequence[int], total: int,
             replicas: Replicas = NO_REPLICAS, files: Iterable[str] = (),
             alone: WritePlan | None = None) -> dict[int, Request]:
    """What a rank of a save sends, by destination: its shards of replicated tensors
    (``infos``) to the owners of the columns it sends (``Replicas.sends``), the named
    files it offers to the owners of their names (``route_files``), and the entries
    its plan of its disjoint tensors (``alone``) creates to the coordinator.
    ``total``: what it holds in all."""
    out: dict[int, list] = {}

    def to(owner: int) -> list:
        return out.setdefault(owner, [total, [], [], {}])

    for owner, mine in route(infos, ranks, replicas.sends(rank), replicas.columns).items():
        to(owner)[1] = mine
    for owner, names in route_files(files, ranks).items():
        to(owner)[2] = names
    if alone is not None and alone.creates:
        to(ranks[0])[3] = alone.created_entries()
    return {owner: tuple(request) for owner, request in out.items()}


@dataclass
class LocalPlan:
    """A rank's side of a save's plan step (DCP's local plan): its ``requests`` to the
    owners, its plan of the tensors it holds alone (the grid's, ``plan_disjoint``),
    and, once the owners replied, its whole plan (``merged``)."""

    rank: int
    shared: list[ShardInfo]
    """Its shards planned across ranks (the others are ``alone``'s)."""
    alone: WritePlan | None
    requests: dict[int, Request]

    @staticmethod
    def build(rank: int, infos: Sequence[ShardInfo], ranks: Sequence[int],
              policy: ChunkPolicy, replicas: Replicas = NO_REPLICAS,
              files: Iterable[str] = ()) -> "LocalPlan":
        """``rank``'s local plan of a save of ``infos`` by ``ranks``, offering to
        write ``files``; the grid's tensors (``Replicas.grid`` beside classes: mixed
        state) planned alone (without a grid, the owners plan every tensor)."""
        shared, alone = replicas.split(infos) if replicas.grid is not None else (
            list(infos), [])
        own = plan_disjoint(rank, alone, policy, replicas.grid) if alone else None
        # the weight of its writes: what it holds of the shared tensors, the same on
        # every member of its class (its own tensors differ), so that the owners of
        # every column weigh the members alike and all agree on the writers
        return LocalPlan(rank, shared, own, requests(rank, shared, ranks, held_bytes(shared),
                                                      replicas, files, own))

    def merged(self, parts: Iterable["Assignment"], owned: Sequence[WriteUnit] = (),
               replicas: Replicas = NO_REPLICAS) -> WritePlan:
        """The rank's plan from the owners' replies (``merge``), joined with its plan
        of the tensors it holds alone."""
        plan = merge(self.rank, parts, owned, replicas, self.shared)
        return plan.joined(self.alone) if self.alone is not None else plan


@dataclass(frozen=True)
class Assignment:
    """What an owner tells one rank: the cells it holds of the owner's tensors, and
    their entries (the coordinator gets every entry); the named files it writes."""

    entries: dict[str, TensorEntry]
    held: tuple[Held, ...] = ()
    files: tuple[str, ...] = ()


def assignments(entries: dict[str, TensorEntry], cells: Sequence[Cell],
                coordinator: int, totals: dict[int, int], replicas: Replicas = NO_REPLICAS,
                column: int = 0) -> dict[int, Assignment]:
    """An owner's plan of column ``column`` of its tensors (``plan_tensors``, from one
    member of each class) cut into each holder's part: one per class, told to the
    members that hear from that column (``Replicas.told``), the same object for all
    of them (pickled once); ``totals``: what each sender holds in all (it sent
    ``held_bytes`` with its shards). The coordinator gets the entries of column 0,
    for the manifest."""
    bundles: dict[tuple[int, ...], list[Held]] = {}
    for sender, held in held_cells(cells, totals, replicas).items():
        bundles.setdefault(replicas.of(sender)[0], []).extend(held)
    out: dict[int, Assignment] = {}
    for members, held in sorted(bundles.items()):
        part = Assignment({k: entries[k] for k in sorted({c.key for c in held})}, tuple(held))
        out.update(dict.fromkeys(replicas.told(members, column), part))
    if entries and not column:
        mine = out.get(coordinator, Assignment({}))
        out[coordinator] = Assignment({**mine.entries, **entries}, mine.held)
    return dict(sorted(out.items()))


def plan_owned(received: dict[int, Request], ranks: Sequence[int], position: int,
               policy: ChunkPolicy, replicas: Replicas = NO_REPLICAS, units: bool = False
               ) -> tuple[dict[int, Assignment], list[WriteUnit]]:
    """An owner's part of a save's plan step, at ``position`` in ``ranks`` (the first
    coordinates): from what the senders sent (``received``), each holder's part
    (``assignments``), each named file's writer (the lowest-ranked rank that offered
    it) and, with ``units``, as an owner of column 0, its tensors' units with every
    holder (``WritePlan.owned``: for checking a plan; a save does not build them, as
    listing every member of every class grows with the job). Raises
    ``CheckpointError`` where the shards disagree."""
    column = column_of(position, len(ranks), replicas.columns)
    entries, cells = plan_tensors({r: m for r, (_, m, _, _) in received.items() if m}, policy)
    parts = assignments(entries, cells, ranks[0],
                        {r: t for r, (t, _, _, _) in received.items()}, replicas, column)
    writers: dict[str, int] = {}
    for rank in sorted(received):
        for name in received[rank][2]:
            writers.setdefault(name, rank)
    for name, rank in sorted(writers.items()):
        part = parts.get(rank, Assignment({}))
        parts[rank] = dataclasses.replace(part, files=(*part.files, name))
    created = merge_entries(request[3] for request in received.values())
    if created:  # sent to the coordinator only: the manifest's disjoint arrays
        part = parts.get(ranks[0], Assignment({}))
        parts[ranks[0]] = dataclasses.replace(part, entries={**part.entries, **created})
    owned = file_units(entries, whole_cells(cells, replicas)) if units and not column else []
    return dict(sorted(parts.items())), owned


def route_files(names: Iterable[str], ranks: Sequence[int]) -> dict[int, list[str]]:
    """The named files a rank offers to write, by the owner that picks each one's
    writer (``owner_of`` the name, over every rank)."""
    out: dict[int, list[str]] = {}
    for name in names:
        out.setdefault(owner_of(name, ranks), []).append(name)
    return out


def whole_cells(cells: Iterable[Cell], replicas: Replicas = NO_REPLICAS) -> list[Cell]:
    """An owner's cells with every member of each holder's class among the holders."""
    if not replicas.classes:
        return list(cells)
    return [dataclasses.replace(cell, holders=tuple(sorted(
        rank for holder in cell.holders for rank in replicas.of(holder)[0])))
        for cell in cells]


def uncovered(infos: Sequence[ShardInfo], entries: dict[str, TensorEntry],
              cells: Iterable[Held]) -> str | None:
    """What is wrong with the cells a rank was told against its own shards, or None
    when they tile them exactly (and the entries fit them). Where ranks claimed to
    hold the same shards (``Replicas``) and do not, a member is told cells cut from
    another member's shards, and this says so before anything is written."""
    boxes: dict[str, list[ShardInfo]] = {}
    for info in infos:
        boxes.setdefault(info.key, []).append(info)
    filled = {id(info): 0 for info in infos}
    for cell in cells:
        inside = [info for info in boxes.get(cell.key, ()) if info.box.contains(cell.box)]
        if not inside:
            return (f"tensor {cell.key}: told to hold {cell.box}, outside this rank's "
                    f"shards of it")
        for info in inside:
            filled[id(info)] += cell.box.numel
    for info in infos:
        entry = entries.get(info.key)
        if filled[id(info)] != info.box.numel or (entry is None and info.box.numel):
            return (f"tensor {info.key}: the cells planned for this rank do not tile its "
                    f"box {info.box}")
        if entry is not None and (entry.shape, entry.dtype) != (tuple(info.global_shape),
                                                                info.dtype):
            return (f"tensor {info.key}: planned as {entry.dtype} {entry.shape}, held as "
                    f"{info.dtype} {tuple(info.global_shape)}")
    return None


def merge(rank: int, parts: Iterable[Assignment], owned: Sequence[WriteUnit] = (),
          replicas: Replicas = NO_REPLICAS,
          infos: Sequence[ShardInfo] | None = None) -> WritePlan:
    """This rank's plan from the owners' ``assignments``: the units it writes
    (``writer_positions``, at its own position: its class's start plus its index in
    it), the arrays whose first file it writes (it creates their metadata), and, as
    an owner, its tensors' units. With its ``infos``, whether what it was told tiles
    its shards (``WritePlan.mismatch``)."""
    entries: dict[str, TensorEntry] = {}
    cells: list[Held] = []
    files: list[str] = []
    for part in parts:
        entries.update(part.entries)
        cells.extend(part.held)
        files.extend(part.files)
    index = replicas.of(rank)[1]
    held = files_of(cells, entries)
    units = sorted((WriteUnit(h.key, h.box, (), h.nbytes, rank)
                    for h, position in zip(held, writer_positions(held))
                    if position == h.position + index), key=lambda u: (u.key, u.box.offset))
    plan = WritePlan(dict(sorted(entries.items())), units, owned=tuple(owned),
                     files=tuple(sorted(files)))
    plan.creates = tuple(sorted(metadata_creators(plan)))
    if infos is not None:
        plan.mismatch = uncovered(infos, entries, cells)
    return plan
