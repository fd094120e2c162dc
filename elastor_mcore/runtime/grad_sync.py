"""Gradient reduction across pipelines whose TP splits differ, and the global norm.

Semantics (``docs/architecture.md``): the loss is the mean over every token of the
global batch, so each pipeline's gradient is a partial sum and the true gradient is
their sum. Every global tensor is cut into the cells of the common refinement of its
holders' shards (``geometry.common_refinement``). For a cell held in several stages
(of several pipelines, or the first and last stage of one pipeline, which share a tied
word embedding), its holders all-reduce it in the group of exactly those holders;
inside one stage the holders are TP replicas with identical gradients (norm weights),
so only the lowest-ranked holder of each stage contributes and the others add zeros:
each stage counts once, and a tied embedding's two uses in one pipeline add up. Cells
that share a holder set are packed into one buffer and one all-reduce.

No rank plans the whole job: each cuts only the tensors it holds, from the boxes their
holders hold, which it derives from the layout (``parallel.holders``), with no gather
of shards. A rank knows only the holder sets it is in; every rank issues its
reductions in one global order (sorted holder sets, or ``backward_order``'s, computed
from each set's own cells, which all its members cut alike), which keeps overlapping
groups from deadlocking. torch creates groups collectively, so every rank creates the
groups of every holder set the layout can give, in sorted order (``Refinement.build``),
and the members of each check that they cut its cells alike before any reduction.

The gradient norm counts every element of every global tensor once: each cell is
counted by its lowest-ranked holder, after reduction.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from elastor_mcore.parallel.groups import GroupCache
from elastor_mcore.parallel.layout import Layout
from elastor_mcore.geometry import Box, Cell, ShardInfo, local_view
from elastor_mcore.parallel.holders import HolderSet, LocalTensor, Placement, plan_rank, short
from elastor_mcore.parallel.shards import (owning_parameter, shard_info, sharded_tensors,
                                           tp_split_dim, view_like)

log = logging.getLogger(__name__)


def grad_buffer(param: torch.nn.Parameter) -> torch.Tensor:
    """Where ``param``'s gradient accumulates: Megatron's fp32 ``main_grad`` in
    mixed-precision runs (``runtime/optimizer.py``), else ``.grad``."""
    return param.main_grad if hasattr(param, "main_grad") else param.grad


@dataclass(frozen=True)
class GroupReduction:
    """One all-reduce this rank issues every step, described for diagnostics
    (``elastic/rank/traffic.py``) without exposing the buffers behind it."""

    holders: tuple[int, ...]    # the ranks of the group, sorted
    nbytes: int                 # bytes this rank all-reduces in it
    contributed_nbytes: int     # of those, bytes whose values this rank contributes


@dataclass
class _Piece:
    grad: torch.Tensor          # view of the cell in this rank's .grad
    contributes: bool           # this rank's stage counts through this rank
    param: torch.nn.Parameter   # the parameter whose gradient ``grad`` is part of


@dataclass
class _Bucket:
    holders: tuple[int, ...]
    group: dist.ProcessGroup
    pieces: list[_Piece]

    @property
    def numel(self) -> int:
        return sum(p.grad.numel() for p in self.pieces)

    def describe(self) -> GroupReduction:
        return GroupReduction(
            self.holders, sum(p.grad.nbytes for p in self.pieces),
            sum(p.grad.nbytes for p in self.pieces if p.contributes))


def reduction_plan(cells: list[Cell], sets: dict[tuple[int, ...], HolderSet], rank: int
                   ) -> dict[tuple[int, ...], list[Cell]]:
    """``rank``'s cells held in more than one stage, grouped by holder set, sorted."""
    reduced = {ranks for ranks, held in sets.items() if spans_stages(held) and rank in ranks}
    plan: dict[tuple[int, ...], list[Cell]] = {}
    for cell in cells:
        if cell.holders in reduced:
            plan.setdefault(cell.holders, []).append(cell)
    return dict(sorted(plan.items()))


def spans_stages(held: HolderSet) -> bool:
    """The holder sets gradient reduction groups: those held in more than one stage."""
    return held.stages > 1


Run = tuple[tuple[int, ...], list[Cell]]
"""One bucket of a reduction: a holder set and cells of it, reduced together."""

BucketOrder = Callable[[dict[tuple[int, ...], list[Cell]]], list[Run]]
"""A reduction plan's buckets in the one order every rank issues them (computed from
the plan alone, so every rank computes the same); default: one bucket per holder set,
sorted by holders."""


def backward_order(position: Callable[[str], float], max_numel: int | None = None
                   ) -> BucketOrder:
    """Buckets for reductions started during the backward pass, as each becomes ready:
    each holder set's cells in the order a backward pass finishes them (descending
    ``position`` of their key, e.g. its layer), cut into buckets of at most
    ``max_numel`` elements (cells are not cut; None: one bucket per holder set); the
    buckets ordered by when a backward pass finishes them (their lowest position,
    last first). Every rank issues them in this order, which keeps collectives on
    overlapping groups from waiting on each other in a cycle (NCCL needs that)."""
    def order(plan: dict[tuple[int, ...], list[Cell]]) -> list[Run]:
        runs: list[tuple[float, tuple[int, ...], int, list[Cell]]] = []
        for holders, cells in plan.items():
            run: list[Cell] = []
            numel = 0
            for cell in sorted(cells, key=lambda c: -position(c.key)):
                if run and max_numel is not None and numel + cell.box.numel > max_numel:
                    runs.append((-position(run[-1].key), holders, len(runs), run))
                    run, numel = [], 0
                run.append(cell)
                numel += cell.box.numel
            runs.append((-position(run[-1].key), holders, len(runs), run))
        return [(holders, run) for _, holders, _, run in sorted(runs, key=lambda r: r[:3])]
    return order


@dataclass
class Pending:
    """A bucket's collective in flight (``start``); ``finish`` completes it."""

    index: int
    flat: torch.Tensor
    work: Any                   # torch.distributed's Work, or None (nothing to wait for)


@dataclass(frozen=True)
class LocalPiece:
    """One ShardedTensor of this rank: its view into ``param`` and its global box."""

    data: torch.Tensor
    param: torch.nn.Parameter
    info: ShardInfo

    def view(self, like_param: torch.Tensor, cell: Box) -> torch.Tensor:
        """The part of ``like_param`` (the parameter, its gradient, anything laid out
        like the parameter) that is ``cell`` of the global tensor."""
        return local_view(view_like(self.data, self.param, like_param), self.info.box, cell)


@dataclass
class Refinement:
    """This rank's tensors cut into the cells of the common refinement of their
    holders' shards, derived from the layout (``parallel.holders``), with this rank's
    pieces (empty on idle ranks); every rank has created the groups of the holder sets
    ``grouped`` selects, in one order. Built on every world rank (collective: the
    groups, each group's check that its members cut their tensors alike, and one
    job-wide flag, so that a model the layout's rules do not describe fails on every
    rank with the reason instead of reducing wrong cells)."""

    cells: list[Cell]                        # every cell of the keys this rank holds
    sets: dict[tuple[int, ...], HolderSet]   # the holder sets of those cells
    shapes: dict[str, tuple[int, ...]]       # global shape of each of those keys
    local: dict[str, LocalPiece]

    @classmethod
    def build(cls, layout: Layout, model: torch.nn.Module | None, cache: GroupCache,
              grouped: Callable[[HolderSet], bool], world_group=None) -> "Refinement":
        rank = dist.get_rank()
        placement = Placement(layout)
        where = placement.where(rank)
        tp = placement.kinds[where.kind].tp if where is not None else 1
        local: dict[str, LocalPiece] = {}
        tensors = []
        for st in sharded_tensors(model) if model is not None else []:
            info = shard_info(st)
            local[info.key] = LocalPiece(st.data, owning_parameter(model, st.data), info)
            tensors.append(LocalTensor(info, tp_split_dim(model, st, tp)))
        plan = plan_rank(placement, rank, tensors, tied_embeddings(model), grouped)
        for ranks in plan.groups:
            cache.get(ranks)
        device = _device(model, world_group)
        problems = list(plan.problems)
        for ranks, digest in plan.digests.items():  # sorted: one order on every member
            both = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=cache.get(ranks))
            if int(both[0]) != -int(both[1]):
                problems.append(f"the ranks {short(ranks)} cut the tensors they share "
                                f"differently")
        _agree(problems, device, world_group)
        shapes = {key: piece.info.global_shape for key, piece in local.items()}
        return cls(plan.cells, plan.sets, shapes, local)


def tied_embeddings(model: torch.nn.Module | None) -> bool:
    """Whether the model's output layer shares the word embedding (mcore's
    ``share_embeddings_and_output_weights``), which last stages then hold too."""
    return model is not None and any(
        getattr(m, "share_embeddings_and_output_weights", False) for m in model.modules())


def _device(model: torch.nn.Module | None, group) -> torch.device:
    """Where this rank's check tensors live: its parameters' device, or on an idle rank
    the backend's (NCCL needs a CUDA tensor)."""
    param = next(model.parameters(), None) if model is not None else None
    if param is not None:
        return param.device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree(problems: list[str], device: torch.device, world_group) -> None:
    """Raise on every rank if any rank found a problem (one all-reduce of one flag)."""
    flag = torch.tensor([1 if problems else 0], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=world_group)
    for problem in problems:
        log.error("gradient cells: %s", problem)
    if int(flag[0]):
        raise ValueError(
            "the gradient-reduction cells cannot be derived from the layout: "
            + ("; ".join(problems[:3]) if problems else "another rank found that its "
               "shards or cells differ (see its log)")
            + ". Each rank derives its holders' boxes from the layout, as mcore's GPTModel "
              "places tensors: decoder.layers.<n>.* on the stage holding layer n, "
              "embedding.* on first stages, the rest on last stages, each split in equal "
              "parts over a stage's TP ranks or held whole; a model placed otherwise "
              "cannot be reduced across heterogeneous pipelines")


@torch.no_grad()
def broadcast_replicas(layout: Layout, model: torch.nn.Module | None, cache: GroupCache,
                       world_group=None) -> int:
    """Give every element of every parameter held in several pipelines the value of its
    lowest-ranked holder (collective over the world; ``model`` None on idle ranks).

    Pipelines of different shapes initialise a layer at different positions of their
    random streams (Megatron seeds by pipeline rank and draws layer by layer), so their
    replicas of one layer start out different; the gradient sums keep replicas equal
    only if they start equal. A tied word embedding's copy on a last stage (Megatron
    fills it with zeros and copies the first stage's over its embedding group, here one
    rank) takes its lowest-ranked holder's on a first stage. Returns the elements this
    rank received."""
    rank = dist.get_rank()
    refinement = Refinement.build(layout, model, cache, spans_stages, world_group)
    received = 0
    for holders, cells in reduction_plan(refinement.cells, refinement.sets, rank).items():
        views = [refinement.local[c.key].view(refinement.local[c.key].param.data, c.box)
                 for c in cells]
        flat = torch.cat([v.reshape(-1) for v in views])
        source = refinement.sets[holders].source
        dist.broadcast(flat, src=source, group=cache.get(holders))
        offset = 0
        for view in views:
            view.copy_(flat[offset:offset + view.numel()].view_as(view))
            offset += view.numel()
        if rank != source:
            received += flat.numel()
    return received


class GradientSynchronizer:
    """Built once per layout on every world rank (group creation is collective).
    ``order`` decides the buckets and the order they are issued in (``BucketOrder``)."""

    def __init__(self, layout: Layout, model: torch.nn.Module | None, cache: GroupCache,
                 world_group=None, order: BucketOrder | None = None) -> None:
        rank = dist.get_rank()
        refinement = Refinement.build(layout, model, cache, spans_stages, world_group)
        cells, sets = refinement.cells, refinement.sets
        plan = reduction_plan(cells, sets, rank)
        self._buckets: list[_Bucket] = []
        self._norm_views: list[torch.Tensor] = []
        self._grads: list[torch.Tensor] = []
        if model is None:
            return
        for p in model.parameters():
            if grad_buffer(p) is None:
                p.grad = torch.zeros_like(p)
        self._grads = [grad_buffer(p) for p in model.parameters()]
        local = refinement.local
        for holders, bucket_cells in (order(plan) if order else plan.items()):
            pieces = []
            for cell in bucket_cells:
                piece = local[cell.key]
                pieces.append(_Piece(piece.view(grad_buffer(piece.param), cell.box),
                                     rank == sets[holders].stage_first, piece.param))
            self._buckets.append(_Bucket(holders, cache.get(holders), pieces))
        for cell in cells:
            if cell.holders[0] == rank:
                piece = local[cell.key]
                self._norm_views.append(piece.view(grad_buffer(piece.param), cell.box))
        log.info("rank %d: %d reduction buckets, %d elements", rank, len(self._buckets),
                 sum(b.numel for b in self._buckets))

    def reductions(self) -> list[GroupReduction]:
        """This rank's all-reduces of one step, in the order it issues them."""
        return [bucket.describe() for bucket in self._buckets]

    def bucket_holders(self) -> list[tuple[int, ...]]:
        """This rank's buckets' holder sets, in issue order."""
        return [bucket.holders for bucket in self._buckets]

    def bucket_parameters(self) -> list[list[torch.nn.Parameter]]:
        """The parameters whose gradients each of this rank's buckets reads."""
        return [list({id(p.param): p.param for p in b.pieces}.values()) for b in self._buckets]

    @torch.no_grad()
    def start(self, index: int) -> Pending:
        """Start the all-reduce of bucket ``index`` (asynchronous)."""
        bucket = self._buckets[index]
        flat = torch.cat([p.grad.reshape(-1) if p.contributes
                          else torch.zeros(p.grad.numel(), dtype=p.grad.dtype,
                                           device=p.grad.device)
                          for p in bucket.pieces])
        return Pending(index, flat, dist.all_reduce(flat, group=bucket.group, async_op=True))

    @torch.no_grad()
    def finish(self, pending: Pending) -> None:
        """Wait for a started bucket and write the sums into the gradients."""
        pending.work.wait()
        offset = 0
        for p in self._buckets[pending.index].pieces:
            n = p.grad.numel()
            p.grad.copy_(pending.flat[offset:offset + n].view_as(p.grad))
            offset += n

    def reduce(self) -> None:
        """Sum gradients across pipelines (in place, in the global bucket order)."""
        for index in range(len(self._buckets)):
            self.finish(self.start(index))

    @torch.no_grad()
    def global_norm(self, active_group) -> float:
        """L2 norm of the full gradient, each global element counted once."""
        local = torch.zeros((), dtype=torch.float64)
        for view in self._norm_views:
            local += view.double().pow(2).sum()
        dist.all_reduce(local, group=active_group)
        return float(local.sqrt())

    @torch.no_grad()
    def scale_(self, factor: float) -> None:
        """Multiply every gradient by ``factor`` (clipping)."""
        for grad in self._grads:
            grad.mul_(factor)


class SequenceParallelGrads:
    """Under sequence parallelism each TP rank's norm weights see only its slice of
    the sequence, so their gradients are partial sums: add them up over the stage's
    TP group (mcore's ``finalize_model_grads`` does this for weights marked
    ``sequence_parallel``) before the cross-pipeline reduction, which then sees TP
    replicas with equal gradients again."""

    def __init__(self, model: torch.nn.Module, tp_group) -> None:
        self.params = [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]
        self.group = tp_group

    @torch.no_grad()
    def reduce(self) -> None:
        if not self.params:
            return
        grads = [grad_buffer(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
