"""Who writes what: turn every rank's shards into write units, each written once.

A write unit is one file (outer chunk) of one tensor; files never straddle a cell of
the common refinement of the tensor's shards, so each has a fixed set of holders and
exactly one writer. Nothing about one tensor depends on another's shards, so each
tensor is planned by one rank, its *owner* (``owner_of``), from the shards of the
ranks that hold it, as DCP plans: each rank's local plan (``route``: its shard
descriptions, by owner), the owners' global plan of their tensors (``build_plan``),
and each rank's part of it (``assignments``, ``merge``). A rank's work and messages
follow the tensors it holds and owns, not the size of the job.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import itertools
import math
import zlib
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from elastor_mcore.checkpoint.format import (
    DTYPE_ITEMSIZE, CheckpointError, ChunkPolicy, TensorEntry, choose_entry, validate_key)
from elastor_mcore.geometry import Box, Cell, ShardInfo, boundaries, common_refinement


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
    """Every unit of the tensors this rank planned as their owner (``merge``)."""

    def bytes_by_rank(self) -> dict[int, int]:
        load: dict[int, int] = {}
        for unit in self.units:
            for rank in unit.holders:
                load.setdefault(rank, 0)
            load[unit.writer] += unit.nbytes
        return load

    def units_of(self, rank: int) -> list[WriteUnit]:
        return [u for u in self.units if u.writer == rank]


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


def _grid(cell: Box, shard: Sequence[int]) -> list[Box]:
    """The file-sized boxes that tile ``cell`` (whose bounds are multiples of ``shard``)."""
    ranges = [range(o, o + s, step) for o, s, step in zip(cell.offset, cell.shape, shard)]
    return [Box(tuple(lo), tuple(min(step, e - l) for l, step, e in zip(lo, shard, cell.end)))
            for lo in itertools.product(*ranges)]


def _key_hash(key: str) -> int:
    """Stable across processes (Python's ``hash`` of a string is not)."""
    return zlib.crc32(key.encode())


def owner_of(key: str, ranks: Sequence[int]) -> int:
    """The rank of ``ranks`` that plans tensor ``key``: spread by a hash of the key,
    so a job's tensors spread over its ranks and each rank owns few."""
    return ranks[_key_hash(key) % len(ranks)]


def route(infos: Iterable[ShardInfo], ranks: Sequence[int]) -> dict[int, list[ShardInfo]]:
    """A rank's local plan: its shard descriptions, by the owner of each tensor (a
    save sends ``held_bytes`` with them)."""
    out: dict[int, list[ShardInfo]] = {}
    for info in infos:
        out.setdefault(owner_of(info.key, ranks), []).append(info)
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
            for cell in cells for box in _grid(cell.box, entries[cell.key].shard)]


@dataclass(frozen=True)
class Held:
    """A cell, or one of its files, as one of its holders learns it from the tensor's
    owner (one per cell: the holder cuts it into files itself, ``files_of``): which
    holder set it belongs to (``group``, a hash of the ranks, and their number), where this
    holder stands in it, and how many bytes each member holds in all (``weights``:
    runs of ``(bytes, members)`` in position order), but not the ranks themselves (a
    set may span the job)."""

    key: str
    box: Box
    nbytes: int
    group: int
    holders: int
    position: int
    weights: tuple[tuple[int, int], ...]


def holder_group(holders: Sequence[int]) -> int:
    """A 64-bit name of a holder set, the same in every process."""
    data = b"".join(r.to_bytes(4, "little") for r in holders)
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


def held_cells(cells: Iterable[Cell], held_bytes: dict[int, int]) -> dict[int, list[Held]]:
    """Each holder's view of ``cells``; ``held_bytes``: what each rank holds in all."""
    out: dict[int, list[Held]] = {}
    weights: dict[tuple[int, ...], tuple[tuple[int, int], ...]] = {}
    for cell in cells:
        group = holder_group(cell.holders)
        if cell.holders not in weights:  # one object per set: pickled once per message
            runs: list[list[int]] = []
            for rank in cell.holders:
                if runs and runs[-1][0] == held_bytes[rank]:
                    runs[-1][1] += 1
                else:
                    runs.append([held_bytes[rank], 1])
            weights[cell.holders] = tuple((w, n) for w, n in runs)
        for position, rank in enumerate(cell.holders):
            out.setdefault(rank, []).append(Held(cell.key, cell.box, 0, group,
                                                 len(cell.holders), position,
                                                 weights[cell.holders]))
    return out


def files_of(cells: Iterable[Held], entries: dict[str, TensorEntry]) -> list[Held]:
    """Held cells cut into their files, by their entries' file grids."""
    return [dataclasses.replace(cell, box=box,
                                nbytes=box.numel * DTYPE_ITEMSIZE[entries[cell.key].dtype])
            for cell in cells for box in _grid(cell.box, entries[cell.key].shard)]


def held_bytes(infos: Iterable[ShardInfo]) -> int:
    """What a rank holds in all: the weight of its writes (``writer_positions``)."""
    return sum(info.box.numel * DTYPE_ITEMSIZE.get(info.dtype, 1) for info in infos)


def build_plan(infos_by_rank: dict[int, Sequence[ShardInfo]],
               policy: ChunkPolicy) -> WritePlan:
    """The whole plan of the tensors in ``infos_by_rank``, in one process: what the
    ranks of a save compute between them (``plan_tensors`` by the owners,
    ``writer_positions`` by the holders)."""
    entries, cells = plan_tensors(infos_by_rank, policy)
    writers: dict[tuple[str, tuple[int, ...]], int] = {}
    totals = {rank: held_bytes(infos) for rank, infos in infos_by_rank.items()}
    for rank, mine in held_cells(cells, totals).items():
        held = files_of(mine, entries)
        for unit, position in zip(held, writer_positions(held)):
            if position == unit.position:
                writers[unit.key, unit.box.offset] = rank
    units = [WriteUnit(u.key, u.box, u.holders, u.nbytes, writers[u.key, u.box.offset])
             for u in file_units(entries, cells)]
    plan = WritePlan(entries, units)
    plan.creates = tuple(sorted(metadata_creators(plan)))
    return plan


def metadata_creators(plan: WritePlan) -> dict[str, int]:
    """Per array, the rank that creates its metadata: the writer of its first file
    (the one at the origin), so ranks that write the same arrays share the work."""
    return {u.key: u.writer for u in plan.units if not any(u.box.offset)}


@dataclass(frozen=True)
class Assignment:
    """What an owner tells one rank: the cells it holds of the owner's tensors, and
    their entries (the coordinator gets every entry)."""

    entries: dict[str, TensorEntry]
    held: tuple[Held, ...] = ()


def assignments(entries: dict[str, TensorEntry], cells: Sequence[Cell],
                coordinator: int, totals: dict[int, int]) -> dict[int, Assignment]:
    """An owner's plan (``plan_tensors``) cut into each holder's part; ``totals``:
    what each holder holds in all (it sent ``held_bytes`` with its shards)."""
    out = {rank: Assignment({k: entries[k] for k in sorted({c.key for c in held})},
                            tuple(held))
           for rank, held in sorted(held_cells(cells, totals).items())}
    if entries:
        out[coordinator] = Assignment(dict(entries), out.get(coordinator,
                                                             Assignment({})).held)
    return out


def merge(rank: int, parts: Iterable[Assignment],
          owned: Sequence[WriteUnit] = ()) -> WritePlan:
    """This rank's plan from the owners' ``assignments``: the units it writes
    (``writer_positions``), the arrays whose first file it writes (it creates their
    metadata), and, as an owner, its tensors' units."""
    entries: dict[str, TensorEntry] = {}
    cells: list[Held] = []
    for part in parts:
        entries.update(part.entries)
        cells.extend(part.held)
    held = files_of(cells, entries)
    units = sorted((WriteUnit(h.key, h.box, (), h.nbytes, rank)
                    for h, position in zip(held, writer_positions(held))
                    if position == h.position), key=lambda u: (u.key, u.box.offset))
    plan = WritePlan(dict(sorted(entries.items())), units, owned=tuple(owned))
    plan.creates = tuple(sorted(metadata_creators(plan)))
    return plan
