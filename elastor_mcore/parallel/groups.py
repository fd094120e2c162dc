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
* ``active``: every rank the layout uses (loss and gradient-norm reductions).

Groups with the same members are created once and shared.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

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
    active = cache.get(layout.ranks)

    pos = layout.position(rank)
    if pos is None:
        log.info("rank %d is idle in layout %s", rank, layout.describe())
        return None
    stage = layout.pipelines[pos.pipeline].stages[pos.stage]
    chain = next(c for c in stage_chains(layout, pos.pipeline) if c[pos.stage] == rank)
    dp_ranks = replica_ranks(layout, rank)
    pipeline_ranks = sorted(layout.pipelines[pos.pipeline].ranks)
    return RankGroups(
        layout=layout, rank=rank, position=pos,
        tp=cache.get(stage.ranks), tp_ranks=list(stage.ranks),
        pp=cache.get(chain), pp_ranks=chain,
        dp=cache.get(dp_ranks), dp_ranks=dp_ranks,
        pipeline=cache.get(pipeline_ranks), pipeline_ranks=pipeline_ranks,
        active=active, singleton=cache.get([rank]),
    )


def install(groups: RankGroups):
    """Point ``megatron.core.parallel_state`` at this rank's groups and return the
    matching ``ProcessGroupCollection`` (passed explicitly to the model as well).

    We set the module globals rather than patch getters: globals are read at call
    time by every ``parallel_state.get_*`` and by the names other modules imported.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    single, single_ranks = groups.singleton, [groups.rank]
    ps._TENSOR_MODEL_PARALLEL_GROUP = groups.tp
    ps._TENSOR_MODEL_PARALLEL_GLOBAL_RANKS = groups.tp_ranks
    ps._MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE = None
    ps._MPU_TENSOR_MODEL_PARALLEL_RANK = None
    ps._PIPELINE_MODEL_PARALLEL_GROUP = groups.pp
    ps._PIPELINE_GLOBAL_RANKS = groups.pp_ranks
    ps._MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = None
    ps._MPU_PIPELINE_MODEL_PARALLEL_RANK = None
    ps._MODEL_PARALLEL_GROUP = groups.pipeline
    ps._MODEL_PARALLEL_GLOBAL_RANKS = groups.pipeline_ranks
    ps._DATA_PARALLEL_GROUP = groups.dp
    ps._DATA_PARALLEL_GROUP_GLOO = groups.dp
    ps._DATA_PARALLEL_GLOBAL_RANKS = groups.dp_ranks
    ps._DATA_PARALLEL_GROUP_WITH_CP = groups.dp
    ps._DATA_PARALLEL_GROUP_WITH_CP_GLOO = groups.dp
    ps._DATA_PARALLEL_GLOBAL_RANKS_WITH_CP = groups.dp_ranks
    ps._CONTEXT_PARALLEL_GROUP = single
    ps._CONTEXT_PARALLEL_GLOBAL_RANKS = single_ranks
    ps._TENSOR_AND_CONTEXT_PARALLEL_GROUP = groups.tp
    ps._EMBEDDING_GROUP = None
    ps._POSITION_EMBEDDING_GROUP = None
    ps._EXPERT_MODEL_PARALLEL_GROUP = single
    ps._EXPERT_TENSOR_PARALLEL_GROUP = groups.tp
    ps._MPU_DATA_PARALLEL_WORLD_SIZE = None
    ps._MPU_DATA_PARALLEL_RANK = None
    if ps._GLOBAL_MEMORY_BUFFER is None:
        ps._set_global_memory_buffer()
    return ProcessGroupCollection(
        tp=groups.tp, pp=groups.pp, mp=groups.pipeline, cp=single, tp_cp=groups.tp,
        dp=groups.dp, dp_cp=groups.dp, embd=None, pos_embd=None)
