"""Each rank's gradient cells, derived from the layout (``parallel.holders``), are the
whole job's: on random heterogeneous layouts (1-4 pipeline shapes, some in several
pipelines, TP 1/2/4, ranks permuted, idle ranks; the seed is in the test id), every
rank's cells, holder sets, stage counts, broadcast sources and contributing holders
equal what the common refinement of every rank's shards gives (computed here, with
``geometry.common_refinement``, as the job-wide gather did); every holder set the
reduction or ZeRO-1 groups is among those every rank creates; and every pair of ranks
issues the reductions they share in the same order. A rank whose real shards break the
layout's rules is told how."""

from __future__ import annotations

import dataclasses

import pytest

from elastor_mcore.geometry import Box, ShardInfo, common_refinement
from elastor_mcore.parallel.holders import (WORD_EMBEDDING, LocalTensor, Placement,
                                            job_holder_sets, mismatches, plan_rank, rank_cells)
from elastor_mcore.parallel.layout import layout_from_dict
from elastor_mcore.parallel.shards import layout_shard_infos, stage_tensors, tp_box
from elastor_mcore.runtime.grad_sync import backward_order, reduction_plan
from tests.test_scale_planning import RECIPE, random_layout

SEEDS = range(24)


def local_tensors(layout, rank: int, tied: bool, prefix: str = "") -> list[LocalTensor]:
    """``rank``'s shards under ``layout`` with their TP-split dimensions; ``tied``: a
    last stage's output layer is the word embedding (mcore's key for it); ``prefix``
    before every key (Megatron-LM's wrappers add ``module.``)."""
    position = layout.position(rank)
    if position is None:
        return []
    stages = layout.pipelines[position.pipeline].stages
    first, last = position.stage == 0, position.stage == len(stages) - 1
    tensors = stage_tensors(RECIPE.model, layout.layer_range(position.pipeline, position.stage),
                            first, last)
    if tied and last:
        tensors[WORD_EMBEDDING] = tensors.pop("output_layer.weight")
    tp = stages[position.stage].tp
    return [LocalTensor(ShardInfo(prefix + key, shape,
                                  tp_box(shape, dim, tp, position.tp_rank), "float32"), dim)
            for key, (shape, dim) in sorted(tensors.items())]


def whole_job(layout, tied: bool, prefix: str = ""):
    """The job-wide reference: every rank's shards, their common refinement, and each
    rank's (pipeline, stage)."""
    infos = {r: [t.info for t in local_tensors(layout, r, tied, prefix)] for r in layout.ranks}
    if not tied and not prefix:  # the simulated shards are mcore's (tests/test_bench_scale.py)
        assert infos == {r: layout_shard_infos(RECIPE.model, layout, r, prefixes=("",))
                         for r in layout.ranks}
    stage_of = {r: (layout.position(r).pipeline, layout.position(r).stage)
                for r in layout.ranks}
    return common_refinement(infos), stage_of


def source(holders, stage_of) -> int:
    """The holder a broadcast starts from, as ``broadcast_replicas`` chose it from the
    job-wide refinement."""
    stages = {stage_of[h] for h in holders}
    if len(stages) == len({pipeline for pipeline, _ in stages}):
        return holders[0]
    return min(h for h in holders if stage_of[h][1] == 0)


@pytest.mark.parametrize("tied,prefix", [(False, ""), (True, ""), (True, "module.")],
                         ids=["untied", "tied", "tied-prefixed"])
@pytest.mark.parametrize("seed", SEEDS)
def test_each_ranks_cells_are_the_whole_jobs(seed, tied, prefix):
    layout = random_layout(seed, copies=1 if seed % 2 else 3)
    reference, stage_of = whole_job(layout, tied, prefix)
    placement = Placement(layout)
    created = {held.ranks for held in job_holder_sets(placement)}
    needed = {c.holders for c in reference
              if len(c.holders) > 1}  # ZeRO-1 groups these; the reduction a subset
    assert needed <= created, (seed, sorted(needed - created)[:3])
    runs = {}
    for rank in range(max(layout.ranks) + 3):  # idle ranks too
        tensors = local_tensors(layout, rank, tied, prefix)
        keys = {t.info.key for t in tensors}
        cells, sets = rank_cells(placement, rank, tensors, tied)
        assert cells == [c for c in reference if c.key in keys], (seed, rank)
        assert mismatches(placement, rank, tensors, tied) == []
        for holders, held in sets.items():
            stages = {stage_of[h] for h in holders}
            assert held.stages == len(stages), (seed, rank, holders)
            assert held.source == source(holders, stage_of), (seed, rank, holders)
            mine = [h for h in holders if rank in stage_of and stage_of[h] == stage_of[rank]]
            assert held.stage_first == min(mine, default=None), (seed, rank, holders)
        plan = reduction_plan(cells, sets, rank)
        assert plan == {h: [c for c in reference if c.holders == h]
                        for h in sorted({c.holders for c in reference})
                        if rank in h and len({stage_of[r] for r in h}) > 1}, (seed, rank)
        order = backward_order(lambda key: int(key.split("layers.")[1].split(".")[0])
                               if "layers" in key else -1, 40)
        runs[rank] = [(holders, tuple(run)) for holders, run in order(plan)]
    digests: dict[tuple[int, ...], set[int]] = {}
    for rank in layout.ranks:  # the members of each group agree on its cells
        plan = plan_rank(placement, rank, local_tensors(layout, rank, tied, prefix), tied,
                         lambda held: len(held.ranks) > 1)
        assert plan.problems == [] and list(plan.digests) == [
            g for g in plan.groups if rank in g], (seed, rank)
        for ranks, digest in plan.digests.items():
            digests.setdefault(ranks, set()).add(digest)
    assert all(len(d) == 1 for d in digests.values()), seed
    for a in runs:  # every two ranks issue the buckets they share in one order
        for b in runs:
            shared = set(runs[a]) & set(runs[b])
            assert [r for r in runs[a] if r in shared] == [r for r in runs[b] if r in shared], \
                (seed, a, b)


def test_a_rank_that_cuts_a_tensor_otherwise_disagrees_with_its_holders():
    """Rank 3 (TP 1) takes a TP-split tensor for a whole one, which its own shard cannot
    show: the digests of the sets it shares with the TP-2 pipelines differ from theirs."""
    layout = layout_from_dict({"pipelines": [
        {"micro_batches": 1, "stages": [{"tp": 1, "layers": 8, "ranks": [3]}]},
        {"micro_batches": 1, "stages": [{"tp": 2, "layers": 8, "ranks": [0, 1]}]},
        {"micro_batches": 1, "stages": [{"tp": 2, "layers": 8, "ranks": [4, 2]}]}]})
    placement = Placement(layout)
    tensors = local_tensors(layout, 3, False)
    split = next(i for i, t in enumerate(tensors) if t.dim is not None)
    tensors[split] = dataclasses.replace(tensors[split], dim=None)
    assert mismatches(placement, 3, tensors, False) == []
    plans = {r: plan_rank(placement, r, tensors if r == 3 else local_tensors(layout, r, False),
                          False, lambda held: len(held.ranks) > 1) for r in layout.ranks}
    for group in ((0, 1, 2, 3, 4), (0, 2, 3), (1, 3, 4)):  # [4, 2] is TP ranks 2, 4
        assert all(plans[3].digests[group] != plans[peer].digests[group]
                   for peer in group if peer != 3), group
        assert len({plans[peer].digests[group] for peer in group if peer != 3}) == 1


def test_a_shard_off_the_layouts_rules_is_named():
    layout = random_layout(1)
    placement = Placement(layout)
    rank = layout.pipelines[0].stages[0].ranks[0]
    tensors = local_tensors(layout, rank, tied=False)
    wrong = tensors[0]
    moved = Box(tuple(o + 1 for o in wrong.info.box.offset), wrong.info.box.shape)
    tensors[0] = dataclasses.replace(wrong, info=dataclasses.replace(wrong.info, box=moved))
    tensors.append(LocalTensor(ShardInfo("decoder.layers.999.x", (4,), Box((0,), (4,)),
                                         "float32"), None))
    problems = mismatches(placement, rank, tensors, tied=False)
    assert len(problems) == 2
    assert f"rank {rank} holds {wrong.info.key} at offset {moved.offset}" in problems[0]
    assert "decoder.layers.999.x, which the layout puts on no stage" in problems[1]
    idle = max(layout.ranks) + 1
    assert "idle" in mismatches(placement, idle, tensors, tied=False)[0]
