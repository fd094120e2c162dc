"""Who writes what: turn every rank's shards into write units, each written once.

Every rank computes the same plan from the same gathered shard descriptions, so the
plan costs one ``all_gather_object`` of metadata and no further agreement. A write
unit is one file (outer chunk) of one tensor; files never straddle a cell of the
common refinement, so each has a fixed set of holders and exactly one writer.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from elastor_mcore.checkpoint.format import (
    DTYPE_ITEMSIZE, CheckpointError, ChunkPolicy, TensorEntry, choose_entry, validate_key)
from elastor_mcore.geometry import Box, ShardInfo, boundaries, common_refinement


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
    entries: dict[str, TensorEntry]
    units: list[WriteUnit]

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
    least-loaded holder (ties: lowest rank). Deterministic for a given input order.
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
        rank = min(units[i].holders, key=lambda r: (load[r], r))
        writer[i] = rank
        load[rank] += units[i].nbytes
    return [WriteUnit(u.key, u.box, u.holders, u.nbytes, writer[i])
            for i, u in enumerate(units)]


def _grid(cell: Box, shard: Sequence[int]) -> list[Box]:
    """The file-sized boxes that tile ``cell`` (whose bounds are multiples of ``shard``)."""
    ranges = [range(o, o + s, step) for o, s, step in zip(cell.offset, cell.shape, shard)]
    return [Box(tuple(lo), tuple(min(step, e - l) for l, step, e in zip(lo, shard, cell.end)))
            for lo in itertools.product(*ranges)]


def build_plan(infos_by_rank: dict[int, Sequence[ShardInfo]],
               policy: ChunkPolicy) -> WritePlan:
    """Index entries and writer assignment for the shards of every rank."""
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
    units = []
    for cell in cells:
        entry = entries[cell.key]
        covered[cell.key] += cell.box.numel
        itemsize = DTYPE_ITEMSIZE[entry.dtype]
        units.extend(WriteUnit(cell.key, box, cell.holders, box.numel * itemsize)
                     for box in _grid(cell.box, entry.shard))
    missing = [k for k, n in covered.items() if n != math.prod(entries[k].shape)]
    if missing:
        raise CheckpointError(
            f"no rank holds part of tensor(s) {missing[:5]}: the saving ranks' shards must "
            f"cover every global tensor")
    return WritePlan(entries, assign_writers(units))
