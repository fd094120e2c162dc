"""Who holds each of a rank's tensors, from the layout: a rank's part of the common
refinement, without gathering every rank's shards.

Gradient reduction and ZeRO-1 (``runtime/grad_sync.py``, ``distributed_optimizer.py``)
cut every global tensor into the cells of the common refinement of its holders' boxes
(``geometry.common_refinement``). Every rank knows the layout, and what a stage holds
follows from it (mcore's ``GPTModel``): ``decoder.layers.<n>.*`` on the stage holding
layer ``n``, ``embedding.*`` on first stages, the rest on last stages, and the word
embedding on last stages too where the output layer shares it (tied); each tensor is
cut over a stage's TP ranks in equal parts along one dimension, or held whole by each
(``shards.tp_box``). So a rank cuts only the tensors it holds, from the boxes their
holders hold (``rank_cells``): its work follows its own tensors and the pipeline shapes
holding them, not the size of the job.

Pipelines of one *shape* (TP and layers of each stage) hold the same boxes: a stage of
such pipelines is one ``StageKind``, and its TP rank ``t`` one *class* of ranks with
identical shards. Cells are cut between classes, then their holders listed as ranks.

torch creates process groups collectively (every rank, one order:
``parallel.groups.GroupCache``), so each rank also lists every holder set the job's
tensors can have (``job_holder_sets``: a TP-split and a whole tensor per run of layers
held by the same stages, and per pipeline end), from the layout alone, idle ranks too.
A model that breaks these rules is caught where it breaks them: each rank compares its
real shards with the rules (``mismatches``), and the members of each holder set compare
their cells of it (``cells_digest``) before any gradient is reduced.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from elastor_mcore.geometry import Box, Cell, ShardInfo, common_refinement
from elastor_mcore.parallel.shards import tp_box

if TYPE_CHECKING:
    from elastor_mcore.parallel.layout import Layout

LAYER_KEY = re.compile(r"(?:^|\.)decoder\.layers\.(\d+)\.")
EMBEDDING_KEY = re.compile(r"(?:^|\.)embedding\.")
"""Keys may carry the model's prefix (``module.`` under Megatron-LM's wrappers)."""
WORD_EMBEDDING = "embedding.word_embeddings.weight"
"""The key a tied output layer's ShardedTensor has on a last stage (mcore's
``LanguageModule.tie_embeddings_and_output_weights_state_dict``), after the prefix."""


@dataclass(frozen=True)
class LocalTensor:
    """A shard this rank holds, with the dimension its tensor's TP ranks split (None:
    each holds it whole)."""

    info: ShardInfo
    dim: int | None


@dataclass(frozen=True)
class StageKind:
    """Stage ``stage`` of every pipeline of one shape: the same layers, TP degree and
    pipeline ends, so TP rank ``t`` of each holds the same boxes."""

    shape: int
    stage: int
    tp: int
    layers: range
    first: bool
    last: bool
    ranks: tuple[tuple[int, ...], ...]
    """The stage's ranks (by TP rank) in each pipeline of the shape."""

    def holds(self, key: str, tied: bool) -> bool:
        layer = LAYER_KEY.search(key)
        if layer is not None:
            return int(layer.group(1)) in self.layers
        if EMBEDDING_KEY.search(key):
            return self.first or (tied and self.last and (
                key == WORD_EMBEDDING or key.endswith("." + WORD_EMBEDDING)))
        return self.last


@dataclass(frozen=True)
class HolderSet:
    """The ranks holding a cell, and what reduction needs to know of them."""

    ranks: tuple[int, ...]
    """Sorted: the group's members, and its place in the one global issue order."""
    stages: int
    """How many stages (of all pipelines) hold it: reduced across them where > 1."""
    source: int
    """The holder whose values every holder starts from: the lowest-ranked, or where
    two stages of one pipeline hold it (a tied embedding), the lowest-ranked on a first
    stage."""
    stage_first: int | None
    """The lowest-ranked holder on the asking rank's stage (it counts for the stage;
    its TP replicas add zeros); None where that stage does not hold it."""


@dataclass(frozen=True)
class Where:
    """A rank's place among the kinds: its kind, which pipeline of the shape, TP rank."""

    kind: int
    copy: int
    tp_rank: int


class Placement:
    """The layout's stage kinds and classes (one per kind and TP rank), built once per
    layout in time linear in its pipelines and stages."""

    def __init__(self, layout: "Layout") -> None:
        shapes: dict[tuple[tuple[int, int], ...], list[int]] = {}
        for p, pipeline in enumerate(layout.pipelines):
            shapes.setdefault(tuple((s.tp, s.layers) for s in pipeline.stages), []).append(p)
        kinds: list[StageKind] = []
        self._pipeline: dict[int, tuple[int, int]] = {}  # pipeline -> (first kind, copy)
        for shape, (stages, pipes) in enumerate(shapes.items()):
            for copy, p in enumerate(pipes):
                self._pipeline[p] = (len(kinds), copy)
            start = 0
            for s, (tp, n) in enumerate(stages):
                kinds.append(StageKind(shape, s, tp, range(start, start + n), s == 0,
                                       s == len(stages) - 1,
                                       tuple(layout.pipelines[p].stages[s].ranks for p in pipes)))
                start += n
        self.kinds = tuple(kinds)
        self.classes = tuple((k, t) for k, kind in enumerate(kinds) for t in range(kind.tp))
        self._base = [0]
        for kind in kinds:
            self._base.append(self._base[-1] + kind.tp)
        self.layout = layout

    def where(self, rank: int) -> Where | None:
        position = self.layout.position(rank)
        if position is None:
            return None
        first, copy = self._pipeline[position.pipeline]
        return Where(first + position.stage, copy, position.tp_rank)

    def members(self, cls: int) -> list[int]:
        k, t = self.classes[cls]
        return [ranks[t] for ranks in self.kinds[k].ranks]

    def holder_set(self, classes: Sequence[int], me: Where | None) -> HolderSet:
        ranks = tuple(sorted(r for c in classes for r in self.members(c)))
        kinds = {self.classes[c][0] for c in classes}
        shapes = [self.kinds[k].shape for k in kinds]
        source = ranks[0] if len(shapes) == len(set(shapes)) else min(
            r for c in classes if self.kinds[self.classes[c][0]].first for r in self.members(c))
        stage_first = None
        if me is not None:
            on_stage = [t for k, t in map(self.classes.__getitem__, classes) if k == me.kind]
            if on_stage:
                stage_first = min(self.kinds[me.kind].ranks[me.copy][t] for t in on_stage)
        return HolderSet(ranks, sum(len(self.kinds[k].ranks) for k in kinds), source,
                         stage_first)

    def cells(self, tensors: Iterable[LocalTensor], tied: bool, me: Where | None
              ) -> tuple[list[Cell], dict[tuple[int, ...], HolderSet]]:
        """Every cell of ``tensors``' global tensors, each with every rank holding it,
        in ``common_refinement``'s order, and the holder sets of those cells."""
        boxes: dict[int, list[ShardInfo]] = {}
        for tensor in tensors:
            info = tensor.info
            for k, kind in enumerate(self.kinds):
                if not kind.holds(info.key, tied):
                    continue
                for t in range(kind.tp):
                    boxes.setdefault(self._base[k] + t, []).append(ShardInfo(
                        info.key, info.global_shape,
                        tp_box(info.global_shape, tensor.dim, kind.tp, t), info.dtype))
        by_classes: dict[tuple[int, ...], HolderSet] = {}
        cells = []
        for cell in common_refinement(boxes):
            held = by_classes.get(cell.holders)
            if held is None:
                held = by_classes[cell.holders] = self.holder_set(cell.holders, me)
            cells.append(Cell(cell.key, cell.box, held.ranks))
        return cells, {held.ranks: held for held in by_classes.values()}


def rank_cells(placement: Placement, rank: int, tensors: Sequence[LocalTensor], tied: bool
               ) -> tuple[list[Cell], dict[tuple[int, ...], HolderSet]]:
    """Every cell of the global tensors ``rank`` holds (``tensors``), with its holders,
    as the whole job's common refinement has them, and their holder sets."""
    return placement.cells(tensors, tied, placement.where(rank))


@dataclass
class RankPlan:
    """What a rank derives from the layout and its own shards, before any collective."""

    cells: list[Cell]
    """Every cell of the tensors it holds (``rank_cells``)."""
    sets: dict[tuple[int, ...], HolderSet]
    groups: list[tuple[int, ...]]
    """Every holder set of the job the caller groups, sorted: every rank creates their
    groups, in this order."""
    digests: dict[tuple[int, ...], int]
    """Per group this rank is in, in ``groups``' order: the digest of its cells of it,
    which the members compare."""
    problems: list[str]
    """Where its shards break the layout's rules (``mismatches``), or a set it holds
    cells of is not among ``groups``."""


def plan_rank(placement: Placement, rank: int, tensors: Sequence[LocalTensor], tied: bool,
              grouped: Callable[[HolderSet], bool]) -> RankPlan:
    """``rank``'s cells, the job's holder sets that ``grouped`` selects, the digests its
    groups compare and the problems it found."""
    problems = mismatches(placement, rank, tensors, tied)
    cells, sets = rank_cells(placement, rank, tensors, tied)
    groups = [held.ranks for held in job_holder_sets(placement) if grouped(held)]
    known = set(groups)
    problems += [f"rank {rank} holds cells of ranks {short(ranks)}, a set the layout gives "
                 f"no tensor" for ranks, held in sets.items()
                 if rank in ranks and grouped(held) and ranks not in known]
    by_set: dict[tuple[int, ...], list[Cell]] = {}
    for cell in cells:
        by_set.setdefault(cell.holders, []).append(cell)
    digests = {ranks: cells_digest(by_set.get(ranks, [])) for ranks in groups if rank in ranks}
    return RankPlan(cells, sets, groups, digests, problems)


def short(ranks: Sequence[int]) -> str:
    """A rank list for a message: the first few of a long one."""
    return str(list(ranks)) if len(ranks) <= 8 else f"{list(ranks[:7])}... ({len(ranks)})"


def job_holder_sets(placement: Placement) -> list[HolderSet]:
    """Every holder set a model's tensors can have under the layout, sorted by ranks:
    those of a tensor split over TP ranks and of one held whole, on each run of layers
    that the same stages hold and on the pipelines' ends (a tied embedding's too)."""
    kinds = placement.kinds
    cuts = sorted({k.layers.start for k in kinds} | {k.layers.stop for k in kinds})
    split = math.lcm(*(k.tp for k in kinds))
    keys = [f"decoder.layers.{start}.{part}" for start, stop in zip(cuts, cuts[1:])
            if stop > start for part in ("split", "whole")]
    keys += ["embedding.split", "embedding.whole", WORD_EMBEDDING, "output.split",
             "output.whole"]
    tensors = []
    for key in keys:
        whole = key.endswith("whole")
        shape = (1,) if whole else (split,)
        tensors.append(LocalTensor(ShardInfo(key, shape, Box((0,), shape), "float32"),
                                   None if whole else 0))
    _, sets = placement.cells(tensors, True, None)
    return [sets[ranks] for ranks in sorted(sets)]


def mismatches(placement: Placement, rank: int, tensors: Sequence[LocalTensor],
               tied: bool) -> list[str]:
    """Where ``rank``'s real shards break the rules its holders are derived by (the
    layout's stage holding the key, equal TP parts), each said in words."""
    me = placement.where(rank)
    if me is None:
        return [f"rank {rank} is idle in the layout but holds {len(tensors)} tensors"] \
            if tensors else []
    kind = placement.kinds[me.kind]
    out = []
    for tensor in tensors:
        info = tensor.info
        expected = tp_box(info.global_shape, tensor.dim, kind.tp, me.tp_rank)
        if not kind.holds(info.key, tied):
            out.append(f"rank {rank} holds {info.key}, which the layout puts on no stage "
                       f"of layers {kind.layers.start}-{kind.layers.stop - 1} "
                       f"(first={kind.first}, last={kind.last})")
        elif info.box != expected:
            out.append(f"rank {rank} holds {info.key} at offset {info.box.offset}, shape "
                       f"{info.box.shape}; TP rank {me.tp_rank} of {kind.tp} would hold "
                       f"offset {expected.offset}, shape {expected.shape}")
    return out


def cells_digest(cells: Iterable[Cell]) -> int:
    """A 62-bit digest of cells (keys and boxes, in order): the members of a holder set
    compare theirs to find a rank that cut the set's tensors differently."""
    h = hashlib.blake2b(digest_size=8)
    for cell in cells:
        h.update(f"{cell.key}|{cell.box.offset}|{cell.box.shape};".encode())
    return int.from_bytes(h.digest(), "little") >> 2
