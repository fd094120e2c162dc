"""ZeRO-1 across heterogeneous replicas: each piece's optimizer state lives once.

A piece is a cell of the common refinement of its holders' shards
(``grad_sync.Refinement``: each rank cuts the tensors it holds, their holders derived
from the layout); its *replica set* is the ranks holding it, which may span
pipelines of different shapes (a TP4 rank and a TP2 rank hold the same quarter of a
weight) and TP replicas (norms). The cells of one replica set form one flat buffer,
in the order gradient reduction uses (``grad_sync``); the buffer is cut into one
contiguous segment per holder, at row boundaries (dim 0) of its cells so that every
owned part of a cell is a box of the global tensor: it is checkpointed as such, in
global coordinates, and any layout, sharded or not, loads it. Cuts fall only on the
file boundaries of an unsharded save of the same layout (``file_rows``), so a ZeRO-1
save writes the files the replicated state's would, as many at any data parallelism,
each from one owner, and every rank knows the file grid of its tensors from the
layout alone (``file_cuts``; the save plans nothing across ranks,
``checkpoint.Replicas.grid``). The price is balance: segments are as even as whole
files allow (within one file of ``numel / holders`` per cut, a holder may own nothing
where a replica set has fewer files than holders; norms and other small tensors stay
whole).

Each step, per replica set in one global order (overlapping groups cannot deadlock):

1. **Reduce-scatter** the gradients: one stage counts once (as in
   ``GradientSynchronizer``: other TP replicas of the same stage add zeros), each
   holder receives the sum over its segment. Sets inside one stage (TP replicas,
   identical gradients) keep their own segment without communication. On NCCL the
   buffer is padded to ``holders x longest segment`` for ``reduce_scatter_tensor``
   where that is at most twice the buffer (``ShardBucket.pads_cheaply``); on gloo,
   and where padding costs more, it is all-reduced whole and each holder keeps its
   segment, which sums in the unsharded run's order (see ``ZeroShards.reduce``).
2. **Norm**: every element is owned by exactly one rank; float64 sums of the owned
   gradients, all-reduced over the active ranks (the sum runs in another order than
   the unsharded norm's, in float64).
3. **AdamW** on the fp32 main parameters of the owned segment only, with their moments.
4. **All-gather** the updated parameters, rounded to the model's dtype, into every
   holder's weights (``all_gather_into_tensor`` of the padded segments on NCCL where
   that pads cheaply; otherwise an all-reduce of the buffer, zero but for each
   holder's segment: ``ZeroShards.start_gather``).

Optimizer state per rank: 12 bytes (fp32 main parameter and two moments) per owned
element, i.e. about 12 bytes per parameter divided by its replica count.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from elastor_mcore.checkpoint import ChunkPolicy, LocalShard
from elastor_mcore.checkpoint.format import choose_entry
from elastor_mcore.config.recipe import Recipe
from elastor_mcore.geometry import Box, Cell, boundaries
from elastor_mcore.parallel.groups import GroupCache
from elastor_mcore.runtime.grad_sync import (BucketOrder, GroupReduction, Pending, Refinement,
                                             grad_buffer)
from elastor_mcore.runtime.optimizer import (
    STATE_BYTES_PER_ELEMENT, AdamWState, add_main_grad, adamw, lr_scheduler)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fragment:
    """The rows (dim 0) of a cell one holder owns, as a box of the global tensor;
    ``offset`` is where they begin in the replica set's flat buffer."""

    cell: Cell
    box: Box
    offset: int


@dataclass(frozen=True)
class ShardBucket:
    """The cells of one replica set and the cut of their flat buffer among holders."""

    holders: tuple[int, ...]
    cells: tuple[Cell, ...]
    reduces: bool
    """Held in several stages (pipelines, or a tied embedding's first and last stage):
    gradients are summed across them."""
    cuts: tuple[int, ...]
    """Flat offsets: holder ``i`` owns ``[cuts[i], cuts[i + 1])``."""

    @property
    def numel(self) -> int:
        return sum(c.box.numel for c in self.cells)

    @property
    def segment_numel(self) -> int:
        """The longest segment: what each holder sends and receives, padded."""
        return max(b - a for a, b in zip(self.cuts, self.cuts[1:]))

    @property
    def pads_cheaply(self) -> bool:
        """Whether the equal-segment collectives (``reduce_scatter_tensor``,
        ``all_gather_into_tensor``, on ``holders x segment_numel``) move at most twice
        the buffer: segments cut at whole files can be far from even (a replica set
        with fewer files than holders: 8B's at 16,384 GPUs padded to 32 times its
        size), and there an all-reduce of the buffer (twice its bytes, and no
        larger) costs less than the padding."""
        return self.segment_numel * len(self.holders) <= 2 * self.numel

    def segment(self, holder: int) -> tuple[int, int]:
        i = self.holders.index(holder)
        return self.cuts[i], self.cuts[i + 1]

    def cell_offsets(self) -> list[int]:
        return [0, *itertools.accumulate(c.box.numel for c in self.cells)]

    def fragments(self, holder: int) -> list[Fragment]:
        """The parts of cells ``holder`` owns, in buffer order."""
        lo, hi = self.segment(holder)
        out = []
        for cell, start in zip(self.cells, self.cell_offsets()):
            a, b = max(lo, start), min(hi, start + cell.box.numel)
            if a >= b:
                continue
            row = row_numel(cell.box)
            first, last = (a - start) // row, (b - start) // row
            offset = (cell.box.offset[0] + first, *cell.box.offset[1:])
            shape = (last - first, *cell.box.shape[1:])
            out.append(Fragment(cell, Box(offset, shape), a))
        return out


def row_numel(box: Box) -> int:
    """Elements of one dim-0 row of ``box``: the unit segments are cut in."""
    if not box.shape:
        raise ValueError("0-d tensors have no rows to shard; keep them out of "
                         "sharded_state_dict or hold them on one rank")
    return math.prod(box.shape[1:])


def row_cuts(cells: Sequence[Cell], parts: int, align: Sequence[int]) -> tuple[int, ...]:
    """Cut the flat buffer of ``cells`` into ``parts`` segments, each cut at the
    boundary nearest ``k * numel / parts`` among the rows of cell ``i`` that are
    multiples of ``align[i]`` (global row numbers) or its end."""
    starts = [0, *itertools.accumulate(c.box.numel for c in cells)]
    total = starts[-1]
    cuts = [0]
    for k in range(1, parts):
        target = k * total // parts
        i = next(i for i, (a, b) in enumerate(zip(starts, starts[1:])) if a <= target < b)
        cell, row, unit = cells[i], row_numel(cells[i].box), align[i]
        first, rows = cell.box.offset[0], cell.box.shape[0]
        below = (first + (target - starts[i]) // row) // unit * unit - first
        allowed = {min(max(below, 0), rows), min(below + unit, rows), rows}
        nearest = min(allowed, key=lambda r: (abs(starts[i] + r * row - target), r))
        cuts.append(max(starts[i] + nearest * row, cuts[-1]))
    cuts.append(total)
    return tuple(cuts)


def shard_buckets(cells: Sequence[Cell], stages: Callable[[tuple[int, ...]], int],
                  align: dict[str, int]) -> list[ShardBucket]:
    """Each replica set's bucket, sorted by holders (the global issue order); cells
    keep the refinement's order, as in the gradient reduction's buckets. ``stages``:
    how many stages hold a set; ``align``: per key, the rows segments may start at
    (multiples of it)."""
    by_holders: dict[tuple[int, ...], list[Cell]] = {}
    for cell in cells:
        by_holders.setdefault(cell.holders, []).append(cell)
    return [ShardBucket(holders, tuple(group), stages(holders) > 1,
                        row_cuts(group, len(holders), [align[c.key] for c in group]))
            for holders, group in sorted(by_holders.items())]


def file_cuts(cells: Sequence[Cell], shapes: dict[str, tuple[int, ...]]
              ) -> dict[str, list[list[int]]]:
    """Per key of ``cells``, the cut points of its holders' boxes along each dim: what
    an unsharded save of the layout chooses its files from (``format.choose_entry``),
    known to every holder of the key from the layout."""
    boxes: dict[str, list[Box]] = {}
    for cell in cells:
        boxes.setdefault(cell.key, []).append(cell.box)
    return {key: boundaries(shapes[key], held) for key, held in boxes.items()}


def file_rows(cells: Sequence[Cell], shapes: dict[str, tuple[int, ...]],
              policy: ChunkPolicy) -> dict[str, int]:
    """Per key, the dim-0 length of the files an unsharded save of these shards
    writes (fp32, ``checkpoint.format.choose_entry``): segments cut only there, so a
    sharded save writes the same files, each from one owner, however many holders
    share a tensor, at the price of balance within one file per cut."""
    return {key: choose_entry(shapes[key], "float32", cuts, policy).shard[0]
            for key, cuts in file_cuts(cells, shapes).items()}


def rank_buckets(cells: Sequence[Cell], shapes: dict[str, tuple[int, ...]],
                 stages: Callable[[tuple[int, ...]], int], rank: int,
                 chunking: ChunkPolicy) -> list[ShardBucket]:
    """The buckets of the replica sets ``rank`` holds cells of, from the cells of its
    keys alone (no collective): what ``ShardPlan.build`` gives it, and what
    ``tools/bench_scale.py`` derives for a simulated rank's ZeRO-1 state."""
    return shard_buckets([c for c in cells if rank in c.holders], stages,
                         file_rows(cells, shapes, chunking))


def planned_state_bytes(buckets: Sequence[ShardBucket], rank: int) -> tuple[int, float]:
    """(bytes of ``rank``'s owned optimizer state, the formula's
    ``12 * numel / holders`` summed over its pieces)."""
    owned, formula = 0, 0.0
    for bucket in buckets:
        if rank in bucket.holders:
            lo, hi = bucket.segment(rank)
            owned += STATE_BYTES_PER_ELEMENT * (hi - lo)
            formula += STATE_BYTES_PER_ELEMENT * bucket.numel / len(bucket.holders)
    return owned, formula


@dataclass
class ShardPlan:
    """This rank's refinement and the buckets of the replica sets it is in, with every
    multi-holder group the layout can give created."""

    refinement: Refinement
    buckets: list[ShardBucket]

    @classmethod
    def build(cls, layout, model: torch.nn.Module | None, cache: GroupCache,
              chunking: ChunkPolicy, world_group=None) -> "ShardPlan":
        """Collective: every world rank calls it (idle ranks with ``model=None``);
        ``chunking`` is the checkpoint's (``runtime.state.chunk_policy``)."""
        refinement = Refinement.build(layout, model, cache, lambda held: len(held.ranks) > 1,
                                      world_group)
        return cls(refinement, rank_buckets(refinement.cells, refinement.shapes,
                                            lambda holders: refinement.sets[holders].stages,
                                            dist.get_rank(), chunking))


def _issue_order(buckets: list[ShardBucket], order: BucketOrder | None) -> list[ShardBucket]:
    """``buckets`` in ``order`` (each bucket whole; default: as given)."""
    if order is None:
        return buckets
    by_holders = {b.holders: b for b in buckets}
    runs = order({b.holders: list(b.cells) for b in buckets})
    if sorted(h for h, _ in runs) != sorted(by_holders) or any(
            len(cells) != len(by_holders[h].cells) for h, cells in runs):
        raise ValueError("a ZeRO-1 bucket order must keep every replica set whole (one "
                         "bucket each): give backward_order no max_numel")
    return [by_holders[h] for h, _ in runs]


@dataclass
class _Owned:
    """One bucket on one holder: its group, views and owned state."""

    bucket: ShardBucket
    group: dist.ProcessGroup | None
    index: int
    grads: list[torch.Tensor]        # this rank's gradient of each cell
    contributes: bool                # this rank counts for its stage
    weights: list[torch.Tensor]      # this rank's weights of each cell
    fragments: list[Fragment]
    mains: list[torch.Tensor]        # fp32 main parameter of each fragment
    owned_grad: torch.Tensor         # the reduced gradient of the segment, padded

    @property
    def span(self) -> tuple[int, int]:
        return self.bucket.cuts[self.index], self.bucket.cuts[self.index + 1]


class ZeroShards:
    """A rank's part of ZeRO-1: its owned segments, their fp32 main parameters, the
    gradient reduce-scatter, the norm and the weights' all-gather. The optimizer that
    steps the main parameters is the caller's (``DistributedOptimizer`` here, an adapter
    of Megatron's optimizer interface in ``integrations/megatron_lm``); every parameter's
    gradient buffer (``grad_sync.grad_buffer``) must exist when it is built.

    ``order`` (a ``grad_sync.BucketOrder`` that keeps each replica set whole) is the
    order this rank issues its buckets' reductions in, and their all-gathers in
    reverse; default: the plan's (sorted by holders)."""

    def __init__(self, plan: ShardPlan, cache: GroupCache, device: torch.device,
                 order: BucketOrder | None = None) -> None:
        rank = dist.get_rank()
        self.plan = plan
        self._buckets: list[_Owned] = []
        local = plan.refinement.local
        for bucket in _issue_order(plan.buckets, order):
            pieces = [local[c.key] for c in bucket.cells]
            fragments = bucket.fragments(rank)
            mains = [torch.empty(frag.box.shape, dtype=torch.float32, device=device)
                     for frag in fragments]
            group = cache.get(bucket.holders) if len(bucket.holders) > 1 else None
            owned = _Owned(
                bucket, group, bucket.holders.index(rank),
                [p.view(grad_buffer(p.param), c.box) for p, c in zip(pieces, bucket.cells)],
                rank == plan.refinement.sets[bucket.holders].stage_first,
                [p.view(p.param.data, c.box) for p, c in zip(pieces, bucket.cells)],
                fragments, mains,
                torch.zeros(bucket.segment_numel, dtype=torch.float32, device=device))
            lo = owned.span[0]
            for frag, main in zip(fragments, mains):
                start = frag.offset - lo
                main.grad = owned.owned_grad[start:start + main.numel()].view(main.shape)
            self._buckets.append(owned)
        self.copy_model_to_main()
        owned_bytes, formula = planned_state_bytes(plan.buckets, rank)
        log.info("rank %d: ZeRO-1 over %d replica sets, optimizer state %d bytes "
                 "(12 B/param / replicas: %.0f); %d bytes allocated (fp32 main parameters "
                 "and reduced-gradient segments)", rank, len(self._buckets), owned_bytes,
                 formula, self.nbytes())

    def nbytes(self) -> int:
        """Bytes of the tensors built for the owned segments: their fp32 main parameters
        and reduced gradients (Adam's moments come with the first step)."""
        return sum(m.nbytes for b in self._buckets for m in b.mains) + sum(
            b.owned_grad.nbytes for b in self._buckets)

    def owned_mains(self) -> list[tuple[Fragment, torch.Tensor]]:
        """Every owned fragment with its fp32 main parameter, in buffer order."""
        return [(f, m) for b in self._buckets for f, m in zip(b.fragments, b.mains)]

    def reduce(self, native: bool | None = None) -> None:
        """Reduce-scatter every replica set's gradients into the owned segments.

        ``native`` (default: on every backend but gloo) runs ``reduce_scatter_tensor``
        on the padded buffer where it pads cheaply (``ShardBucket.pads_cheaply``);
        otherwise an all-reduce of the unpadded buffer, of
        which each holder keeps its segment: gloo then sums every element in the
        order the unsharded run's all-reduce does (its reduce-scatter of the padded
        buffer does not, measured: 1-ulp differences with three pipelines), so
        losses match the unsharded run bit for bit, for the price of an all-reduce's
        traffic (CPU runs).
        """
        for index in range(len(self._buckets)):
            self.finish(self.start(index, native))

    def bucket_holders(self) -> list[tuple[int, ...]]:
        """This rank's buckets' holder sets, in issue order."""
        return [b.bucket.holders for b in self._buckets]

    def bucket_parameters(self) -> list[list[torch.nn.Parameter]]:
        """The parameters whose gradients (and weights) each of this rank's buckets
        reads (and writes)."""
        local = self.plan.refinement.local
        return [list({id(p): p for p in (local[c.key].param for c in b.bucket.cells)}.values())
                for b in self._buckets]

    @torch.no_grad()
    def start(self, index: int, native: bool | None = None) -> Pending:
        """Start bucket ``index``'s reduction into the owned segment (asynchronous;
        ``native`` as in ``reduce``)."""
        b = self._buckets[index]
        flat = torch.cat([g.reshape(-1) for g in b.grads])
        if not b.bucket.reduces:
            return Pending(index, flat, None)
        if not b.contributes:
            flat.zero_()
        if self._native(b, native):
            return Pending(index, b.owned_grad, dist.reduce_scatter_tensor(
                b.owned_grad, self._padded(b, flat), group=b.group, async_op=True))
        return Pending(index, flat, dist.all_reduce(flat, group=b.group, async_op=True))

    @torch.no_grad()
    def finish(self, pending: Pending) -> None:
        """Wait for a started reduction; the owned segment then holds its sum."""
        b = self._buckets[pending.index]
        if pending.work is not None:
            pending.work.wait()
        if pending.flat is not b.owned_grad:
            lo, hi = b.span
            b.owned_grad[:hi - lo].copy_(pending.flat[lo:hi])

    def reductions(self) -> list[GroupReduction]:
        """The gradient collectives of one step as ``GradientSynchronizer`` describes
        its all-reduces (``elastic/rank/traffic.py``): on gloo they are those all-reduces;
        NCCL's reduce-scatter moves half their bytes, the weights' all-gather the rest."""
        return [GroupReduction(b.bucket.holders, 4 * b.bucket.numel,
                               4 * b.bucket.numel if b.contributes else 0)
                for b in self._buckets if b.bucket.reduces]

    def owned_grads(self) -> list[torch.Tensor]:
        """The reduced gradient of each owned segment (after ``reduce``)."""
        return [b.owned_grad[:b.span[1] - b.span[0]] for b in self._buckets]

    @staticmethod
    def _native(b: _Owned, native: bool | None) -> bool:
        """Whether bucket ``b`` runs the equal-segment collective (``native``, by
        default on every backend but gloo) rather than an all-reduce: only where its
        padding is cheap."""
        return b.bucket.pads_cheaply and (
            native if native is not None else dist.get_backend(b.group) != "gloo")

    @staticmethod
    def _padded(b: _Owned, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` laid out as ``holders x segment_numel``, each segment padded."""
        bucket, size = b.bucket, b.bucket.segment_numel
        if bucket.numel == size * len(bucket.holders):
            return flat
        padded = flat.new_zeros(size * len(bucket.holders))
        for i, (a, e) in enumerate(zip(bucket.cuts, bucket.cuts[1:])):
            padded[i * size:i * size + e - a].copy_(flat[a:e])
        return padded

    @torch.no_grad()
    def global_norm(self, active_group) -> float:
        """L2 norm of the full gradient: each element counted by its one owner."""
        local = torch.zeros((), dtype=torch.float64)
        for b in self._buckets:
            lo, hi = b.span
            local += b.owned_grad[:hi - lo].double().pow(2).sum()
        dist.all_reduce(local, group=active_group)
        return float(local.sqrt())

    @torch.no_grad()
    def scale_(self, factor: float) -> None:
        for b in self._buckets:
            b.owned_grad.mul_(factor)

    def copy_main_to_model(self, native: bool | None = None) -> None:
        """All-gather every replica set's main parameters, rounded to the weights'
        dtype, into the weights (after a step or a load); ``native`` as in
        ``start_gather``."""
        for index in reversed(range(len(self._buckets))):
            self.finish_gather(self.start_gather(index, native))

    @torch.no_grad()
    def start_gather(self, index: int, native: bool | None = None) -> Pending:
        """Start the all-gather of bucket ``index``'s main parameters (asynchronous).
        Buckets are gathered in the reverse of their reduction order: the order a
        forward pass needs them in. ``native`` (default: on every backend but gloo)
        runs ``all_gather_into_tensor`` on the padded segments where that pads
        cheaply (``ShardBucket.pads_cheaply``); otherwise an all-reduce of the
        whole buffer, zero but for each holder's own segment, gathers it: exactly
        (each element is one holder's value plus zeros), in twice the buffer's bytes."""
        b = self._buckets[index]
        lo, hi = b.span
        padded = b.group is None or self._native(b, native)
        mine = torch.zeros(b.bucket.segment_numel if padded else b.bucket.numel,
                           dtype=b.weights[0].dtype, device=b.owned_grad.device)
        if b.mains:
            start = 0 if padded else lo
            mine[start:start + hi - lo].copy_(torch.cat([m.reshape(-1) for m in b.mains]))
        if b.group is None:
            return Pending(index, mine, None)
        if not padded:
            return Pending(index, mine, dist.all_reduce(mine, group=b.group, async_op=True))
        size = b.bucket.segment_numel
        gathered = mine.new_empty(size * len(b.bucket.holders))
        return Pending(index, gathered,
                       dist.all_gather_into_tensor(gathered, mine, group=b.group, async_op=True))

    @torch.no_grad()
    def finish_gather(self, pending: Pending) -> None:
        """Wait for a started all-gather and write the parameters into the weights."""
        b = self._buckets[pending.index]
        flat = pending.flat
        if pending.work is not None:
            pending.work.wait()
        if flat.numel() != b.bucket.numel:  # padded segments, gathered
            size = b.bucket.segment_numel
            flat = torch.cat([flat[i * size:i * size + e - a]
                              for i, (a, e) in enumerate(zip(b.bucket.cuts, b.bucket.cuts[1:]))])
        for weight, start in zip(b.weights, b.bucket.cell_offsets()):
            weight.copy_(flat[start:start + weight.numel()].view(weight.shape))

    @torch.no_grad()
    def copy_model_to_main(self) -> None:
        """The owned main parameters from the weights (after a load of weights only)."""
        local = self.plan.refinement.local
        for fragment, main in self.owned_mains():
            piece = local[fragment.cell.key]
            main.copy_(piece.view(piece.param.detach(), fragment.box))

    def main_shards(self) -> list[LocalShard]:
        """The owned fp32 main parameters as boxes of their global tensors; each
        ``data`` is the tensor AdamW updates (its moments are ``state[data]``)."""
        shapes = self.plan.refinement.shapes
        return [LocalShard(f.cell.key, shapes[f.cell.key], f.box.offset, m)
                for b in self._buckets for f, m in zip(b.fragments, b.mains)]

    def file_grid(self) -> dict[str, list[list[int]]]:
        """Per key of this rank's tensors, the cuts its checkpoint files are chosen
        from (``file_cuts``): the grid a save of ``main_shards`` needs
        (``checkpoint.Replicas.grid``), the segments being cut at its file rows."""
        return file_cuts(self.plan.refinement.cells, self.plan.refinement.shapes)

    def expected_state_nbytes(self) -> float:
        """The formula: 12 bytes per parameter divided by its replica count."""
        return planned_state_bytes(self.plan.buckets, dist.get_rank())[1]


class DistributedOptimizer(ZeroShards, AdamWState):
    """A rank's ZeRO-1 AdamW for ``elastor train``: its gradient reduction, norm and
    clipping too (it plays ``GradientSynchronizer``'s part in the step), and the lr
    schedule."""

    def __init__(self, model: torch.nn.Module, recipe: Recipe, plan: ShardPlan,
                 cache: GroupCache) -> None:
        self.recipe = recipe
        self.params = list(model.parameters())
        self.mixed = recipe.training.params_dtype != "float32"
        for p in self.params:
            if self.mixed:
                add_main_grad(p)
            elif p.grad is None:
                p.grad = torch.zeros_like(p)
        super().__init__(plan, cache, self.params[0].device)
        mains = self.owned_mains()
        shapes = plan.refinement.shapes
        self.adamw = adamw(recipe, [m for f, m in mains if len(shapes[f.cell.key]) > 1],
                           [m for f, m in mains if len(shapes[f.cell.key]) <= 1])
        self.scheduler = lr_scheduler(self.adamw, recipe)

    # The step, in the order ``StageRunner.train_step`` calls it: zero_grad, reduce,
    # global_norm, scale_ (clipping), step.

    def zero_grad(self) -> None:
        for p in self.params:
            if self.mixed:
                p.main_grad.zero_()
                p.grad = None
            else:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on the owned main parameters, all-gather them into the weights,
        advance the schedule."""
        self.adamw.step()
        self.copy_main_to_model()
        self.scheduler.step(increment=self.recipe.training.global_batch_size)
