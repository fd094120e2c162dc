"""Process groups for a layout, installed where Megatron-Core looks for them.

Every rank of the world creates every group, in one deterministic order (gloo and
NCCL require it), and keeps the ones it belongs to. For a rank in stage ``s`` of
pipeline ``p``:

* ``tp``: the ranks of its stage.
* ``pp``: a *stage chain* holding one rank per stage of its pipeline, in stage order,
  so that ``pp.rank()`` is the stage index and ``pp.size()`` the stage count (GPTModel
  reads both from the group). Chain ``j`` of a pipeline takes, in each stage, TP rank
  ``j * tp_stage // max_tp``; with different TP per stage a rank may sit in several
  chains, and we never run collectives on them (the schedule has its own P2P).
* ``dp``: the exact replicas of its shard (same layers, TP degree and TP rank in the
  other pipelines). For uniform layouts this is Megatron's data-parallel group.
* ``pipeline``: every rank of its pipeline (mcore's model-parallel group).
* ``tp_dp``: the stages of all its replicas (mcore's tensor-and-data-parallel group).
* ``active``: every rank the layout uses (loss and gradient-norm reductions).

``install`` gives every ``parallel_state`` global of the installed Megatron-Core one of
these; it is the one way elastor changes ``parallel_state``, for its own runtime and
for Megatron-LM's (whose ``initialize_model_parallel`` the integration replaces by a
call to it). ``elastor_mcore.compat.mcore.install_parallel_state`` does the writing
and decides which group each global gets, per version.

Groups with the same members are created once and shared.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch.distributed as dist

from elastor_mcore.parallel.layout import Layout, RankPosition

log = logging.getLogger(__name__)


class GroupCache:
    """Creates each distinct rank set's group once. Every world rank must call
    ``get`` with the same sequence of rank sets."""

    def __init__(self) -> None:
        self._groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}

    def get(self, ranks) -> dist.ProcessGroup | None:
        """The group of ``ranks`` (None on ranks outside it)."""
        key = tuple(sorted(ranks))
        if key not in self._groups:
            self._groups[key] = dist.new_group(list(key))
        group = self._groups[key]
        return group if dist.get_rank() in key else None


@dataclass
class RankGroups:
    """The groups of one active rank."""

    layout: Layout
    rank: int
    position: RankPosition
    tp: dist.ProcessGroup
    tp_ranks: list[int]
    pp: dist.ProcessGroup
    pp_ranks: list[int]
    dp: dist.ProcessGroup
    dp_ranks: list[int]
    pipeline: dist.ProcessGroup
    pipeline_ranks: list[int]
    active: dist.ProcessGroup
    singleton: dist.ProcessGroup
    tp_dp: dist.ProcessGroup | None = None
    tp_dp_ranks: list[int] = field(default_factory=list)

    @property
    def num_stages(self) -> int:
        return len(self.layout.pipelines[self.position.pipeline].stages)

    @property
    def is_first_stage(self) -> bool:
        return self.position.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.position.stage == self.num_stages - 1


def stage_chains(layout: Layout, pipeline: int) -> list[list[int]]:
    """The stage chains of a pipeline (see module docstring)."""
    stages = layout.pipelines[pipeline].stages
    max_tp = max(s.tp for s in stages)
    return [[s.ranks[j * s.tp // max_tp] for s in stages] for j in range(max_tp)]


def replica_ranks(layout: Layout, rank: int) -> list[int]:
    """Ranks holding exactly the same shard as ``rank`` (itself included)."""
    pos = layout.position(rank)
    stage = layout.pipelines[pos.pipeline].stages[pos.stage]
    layers = layout.layer_range(pos.pipeline, pos.stage)
    num_stages = len(layout.pipelines[pos.pipeline].stages)
    out = []
    for p, s, other in layout.iter_stages():
        same_role = (s == 0) == (pos.stage == 0) and \
            (s == len(layout.pipelines[p].stages) - 1) == (pos.stage == num_stages - 1)
        if other.tp == stage.tp and layout.layer_range(p, s) == layers and same_role:
            out.append(other.ranks[pos.tp_rank])
    return sorted(out)


def tensor_and_data_ranks(layout: Layout, rank: int) -> list[int]:
    """Every rank of the stages that hold a replica of ``rank``'s shard."""
    out = set()
    for r in replica_ranks(layout, rank):
        pos = layout.position(r)
        out.update(layout.pipelines[pos.pipeline].stages[pos.stage].ranks)
    return sorted(out)


def build_groups(layout: Layout, cache: GroupCache) -> RankGroups | None:
    """Create the layout's groups on every world rank; None on idle ranks."""
    rank = dist.get_rank()
    if dist.get_world_size() < layout.world_size:
        raise RuntimeError(
            f"layout needs {layout.world_size} ranks but the world has {dist.get_world_size()}")
    for r in range(dist.get_world_size()):
        cache.get([r])
    for _, _, stage in layout.iter_stages():
        cache.get(stage.ranks)
    for p in range(len(layout.pipelines)):
        for chain in stage_chains(layout, p):
            cache.get(chain)
    for r in layout.ranks:
        cache.get(replica_ranks(layout, r))
    for pipe in layout.pipelines:
        cache.get(pipe.ranks)
    for r in layout.ranks:
        cache.get(tensor_and_data_ranks(layout, r))
    active = cache.get(layout.ranks)

    pos = layout.position(rank)
    if pos is None:
        log.info("rank %d is idle in layout %s", rank, layout.describe())
        return None
    stage = layout.pipelines[pos.pipeline].stages[pos.stage]
    chain = next(c for c in stage_chains(layout, pos.pipeline) if c[pos.stage] == rank)
    dp_ranks = replica_ranks(layout, rank)
    pipeline_ranks = sorted(layout.pipelines[pos.pipeline].ranks)
    tp_dp_ranks = tensor_and_data_ranks(layout, rank)
    return RankGroups(
        layout=layout, rank=rank, position=pos,
        tp=cache.get(stage.ranks), tp_ranks=list(stage.ranks),
        pp=cache.get(chain), pp_ranks=chain,
        dp=cache.get(dp_ranks), dp_ranks=dp_ranks,
        pipeline=cache.get(pipeline_ranks), pipeline_ranks=pipeline_ranks,
        tp_dp=cache.get(tp_dp_ranks), tp_dp_ranks=tp_dp_ranks,
        active=active, singleton=cache.get([rank]),
    )


def rank_axes(groups: RankGroups):
    """This rank's groups as ``compat.mcore`` names the axes of ``parallel_state``."""
    from elastor_mcore.compat.mcore import Axis, RankAxes

    rank = groups.rank
    holds_embedding = groups.is_first_stage or groups.is_last_stage
    return RankAxes(
        rank=rank,
        tp=Axis(groups.tp, sorted(groups.tp_ranks)),
        pp=Axis(groups.pp, list(groups.pp_ranks)),
        dp=Axis(groups.dp, list(groups.dp_ranks)),
        model=Axis(groups.pipeline, list(groups.pipeline_ranks)),
        tp_dp=Axis(groups.tp_dp, list(groups.tp_dp_ranks)),
        active=Axis(groups.active, list(groups.layout.ranks)),
        single=Axis(groups.singleton, [rank]),
        stage=groups.position.stage, num_stages=groups.num_stages,
        tp_rank=groups.tp.rank(), dp_rank=groups.dp.rank(),
        embedding_ranks=[rank] if holds_embedding else [],
        position_embedding_ranks=[rank] if groups.is_first_stage else [],
    )


def install(groups: RankGroups):
    """Point ``megatron.core.parallel_state`` at this rank's groups and return the
    matching ``ProcessGroupCollection`` (passed explicitly to the model as well). Any
    groups installed before (elastor's or mcore's own) are replaced, not destroyed.

    Every process-group global, ranks list and rank/world-size override the installed
    mcore defines is set (``compat.mcore.install_parallel_state``): module globals
    rather than patched getters, because globals are read at call time by every
    ``parallel_state.get_*`` and by the names other modules imported.
    """
    from elastor_mcore.compat import mcore

    mcore.install_parallel_state(rank_axes(groups))
    return mcore.process_group_collection()
