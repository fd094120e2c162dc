"""Boxes of global tensors and their common refinement: pure geometry, no torch.

A rank holds a *box* (offset and shape per dimension) of each global tensor. The key
operation is the *common refinement*: given the boxes every rank holds of every
global tensor, cut each tensor into cells such that every cell is either wholly
inside or wholly outside each rank's box. Each cell then has a fixed set of holders.
Gradient reduction (one group per holder set) and the checkpoint (each cell written
once) are both built on it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Iterable, Sequence


@dataclass(frozen=True)
class Box:
    """An axis-aligned region of a global tensor: ``offset`` and ``shape`` per dim."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def end(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offset, self.shape))

    def contains(self, other: "Box") -> bool:
        return all(o <= oo and oo + os <= o + s
                   for o, s, oo, os in zip(self.offset, self.shape, other.offset, other.shape))

    def intersect(self, other: "Box") -> "Box | None":
        lo = tuple(max(a, b) for a, b in zip(self.offset, other.offset))
        hi = tuple(min(a, b) for a, b in zip(self.end, other.end))
        if any(h <= l for l, h in zip(lo, hi)):
            return None
        return Box(lo, tuple(h - l for l, h in zip(lo, hi)))

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offset, self.shape))


@dataclass(frozen=True)
class ShardInfo:
    """Picklable description of one local shard of a global tensor."""

    key: str
    global_shape: tuple[int, ...]
    box: Box
    dtype: str


@dataclass(frozen=True)
class Cell:
    """A piece of a global tensor held, whole, by exactly the ranks in ``holders``."""

    key: str
    box: Box
    holders: tuple[int, ...]


def boundaries(shape: Sequence[int], boxes: Iterable[Box]) -> list[list[int]]:
    """Per dimension of a tensor of ``shape``, the sorted points where some box starts
    or ends (the tensor's own ends included): the cuts every shard split agrees with."""
    points = [{0, n} for n in shape]
    for box in boxes:
        for dim, (lo, hi) in enumerate(zip(box.offset, box.end)):
            points[dim].update((lo, hi))
    return [sorted(p) for p in points]


def common_refinement(infos_by_rank: dict[int, Sequence[ShardInfo]]) -> list[Cell]:
    """Cut every global tensor into cells along every rank's shard boundaries.

    Deterministic: every rank computing it from the same gathered input gets the same
    list, in the same order (by key, then cell offset).
    """
    boxes: dict[str, list[tuple[int, Box]]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for rank in sorted(infos_by_rank):
        for info in infos_by_rank[rank]:
            if shapes.setdefault(info.key, info.global_shape) != info.global_shape:
                raise ValueError(
                    f"ranks disagree on the global shape of {info.key}: "
                    f"{shapes[info.key]} vs {info.global_shape}")
            boxes.setdefault(info.key, []).append((rank, info.box))
    cells = []
    for key in sorted(boxes):
        cuts = boundaries(shapes[key], [box for _, box in boxes[key]])
        position = [{point: i for i, point in enumerate(c)} for c in cuts]
        holders: dict[tuple[int, ...], set[int]] = {}
        for rank, box in boxes[key]:  # each box adds its rank to the cells it covers
            spans = [range(at[lo], at[lo + n])
                     for at, lo, n in zip(position, box.offset, box.shape)]
            for cell in itertools.product(*spans):
                holders.setdefault(cell, set()).add(rank)
        for cell in sorted(holders):  # by offset: the order of the cells' positions
            cells.append(Cell(key, Box(tuple(c[i] for c, i in zip(cuts, cell)),
                                       tuple(c[i + 1] - c[i] for c, i in zip(cuts, cell))),
                              tuple(sorted(holders[cell]))))
    return cells


def grid_cut(box: Box, step: Sequence[int]) -> list[Box]:
    """``box`` cut where it crosses a multiple of ``step`` along each dimension (a
    tensor's file grid): the pieces, in offset order (none where ``box`` is empty)."""
    ranges = []
    for lo, hi, n in zip(box.offset, box.end, step):
        cuts = [lo, *range((lo // n + 1) * n, hi, n), hi] if hi > lo else []
        ranges.append(list(zip(cuts, cuts[1:])))
    return [Box(tuple(a for a, _ in span), tuple(b - a for a, b in span))
            for span in itertools.product(*ranges)]


def local_view(tensor: Any, held: Box, cell: Box) -> Any:
    """The part of a local shard ``tensor`` (a torch tensor covering ``held``) that is
    ``cell``: a view, by ``narrow`` along each dimension."""
    for dim, (co, ho, size) in enumerate(zip(cell.offset, held.offset, cell.shape)):
        tensor = tensor.narrow(dim, co - ho, size)
    return tensor
