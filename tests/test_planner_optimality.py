"""The planner's search against brute force on small clusters, under the same cost model.

``exhaustive_best`` shares nothing with the search but the cost model's public
functions. It enumerates, per node, every multiset of TP groups from its alive GPUs
(any of them may stay idle), every way to split all chosen groups (tagged with their
node) into pipelines, every order of every pipeline, every layer split (checked
against ``CostModel.stage_memory`` with the layout's number of pipelines, which under
ZeRO-1 split the optimizer state) and every micro-batch split. Two exact shortcuts
keep it fast: for fixed micro-batches the step time is a maximum of independent
per-pipeline terms, so each ordered pipeline takes its own best layer split; and
results are memoised by pipeline and pipeline count.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from functools import lru_cache

import pytest

from elastor_mcore.planner import CostModel, hardware_from_dict, plan
from elastor_mcore.planner.cost_model import GIB
from elastor_mcore.planner.search import EXACT_CLUSTER_GPUS, EXACT_POOL_GROUPS
from elastor_mcore.config.recipe import load_recipe, recipe_from_dict

REL_TOL = 1e-9
"""Float rounding only: the search and the brute force add the same terms in other orders."""

TINY = load_recipe("recipes/tiny-llama.yaml")
WIDER = recipe_from_dict({
    "name": "wider-toy",
    "model": {"num_layers": 8, "hidden_size": 256, "num_attention_heads": 8,
              "num_query_groups": 4, "ffn_hidden_size": 768, "vocab_size": 1000,
              "seq_length": 128},
    "training": {"global_batch_size": 16, "micro_batch_size": 1}})
# Six heads: TP groups of 3 and 6 GPUs are allowed (not only powers of two).
THIRDS = recipe_from_dict({
    "name": "thirds-toy",
    "model": {"num_layers": 8, "hidden_size": 384, "num_attention_heads": 6,
              "num_query_groups": 6, "ffn_hidden_size": 1152, "vocab_size": 1000,
              "seq_length": 128},
    "training": {"global_batch_size": 16, "micro_batch_size": 1}})



def with_optimizer(recipe, distributed: bool, params_dtype: str | None = None):
    """``recipe`` with or without the distributed optimizer (ZeRO-1), in
    ``params_dtype`` (default: the recipe's)."""
    return dataclasses.replace(recipe, training=dataclasses.replace(
        recipe.training, distributed_optimizer=distributed,
        params_dtype=params_dtype or recipe.training.params_dtype))


def rejected_unsplit(cost: CostModel, layout, capacity: float) -> bool:
    """Whether some stage of ``layout`` would not fit in ``capacity`` bytes with its
    whole optimizer state (one replica: the search's upper bound before it counted
    ZeRO-1's split)."""
    return any(cost.stage_memory(s.tp, s.layers, j, len(p.stages)).total > capacity
               for p in layout.pipelines for j, s in enumerate(p.stages))


WIDER_ZERO1 = with_optimizer(WIDER, True, "bfloat16")
THIRDS_ZERO1 = with_optimizer(THIRDS, True, "bfloat16")

CPU = dict(gpus_per_node=4, memory_per_gpu_gib=4, memory_reserved_gib=0.5, peak_tflops=0.05,
           efficiency_by_tp={1: 0.3, 2: 0.28, 4: 0.25}, intra_node_bandwidth_gb_s=2,
           inter_node_bandwidth_gb_s=1, intra_node_latency_us=50, inter_node_latency_us=100)
# Fast compute, fast links, little memory: TP pays off and layers per GPU are capped.
TIGHT = dict(gpus_per_node=8, memory_per_gpu_gib=0.05, memory_reserved_gib=0.01,
             peak_tflops=2.0, efficiency_by_tp={1: 0.5, 2: 0.49, 4: 0.47},
             intra_node_bandwidth_gb_s=50, inter_node_bandwidth_gb_s=10,
             intra_node_latency_us=5, inter_node_latency_us=10)


def _compositions(total: int, parts: int, minimum: tuple[int, ...]):
    """Every tuple of ``parts`` integers >= ``minimum`` summing to ``total``."""
    spare = total - sum(minimum)
    if spare < 0:
        return
    for cuts in itertools.combinations(range(spare + parts - 1), parts - 1):
        bounds = (-1,) + cuts + (spare + parts - 1,)
        yield tuple(minimum[i] + bounds[i + 1] - bounds[i] - 1 for i in range(parts))


def _set_partitions(items: list):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _set_partitions(rest):
        yield [[first]] + part
        for i in range(len(part)):
            yield part[:i] + [[first] + part[i]] + part[i + 1:]


def _node_groupings(alive: int, sizes: tuple[int, ...]):
    """Every multiset of group sizes using at most ``alive`` GPUs (the rest idle)."""
    return sorted(tuple(sorted(combo, reverse=True))
                  for n in range(alive + 1)
                  for combo in itertools.combinations_with_replacement(sizes, n)
                  if sum(combo) <= alive)


def exhaustive_best(cost: CostModel, alive_by_node: dict[int, int],
                    sizes: tuple[int, ...], count_replicas: bool = True) -> float:
    """The fastest step; ``count_replicas=False`` charges every rank its whole optimizer
    state (the search's upper bound before it counted ZeRO-1's sharding)."""
    layers, micro = cost.num_layers, cost.total_micro_batches
    capacity = cost.hardware.memory_per_gpu_gib * GIB

    @lru_cache(maxsize=None)
    def best_pipeline(order: tuple[int, ...], intra: bool, pipelines: int) -> float:
        n, best = len(order), math.inf
        replicas = pipelines if count_replicas else 1
        for split in _compositions(layers, n, (1,) * n):
            stages = [(tp, l, j) for j, (tp, l) in enumerate(zip(order, split))]
            if any(cost.stage_memory(tp, l, j, n, replicas).total > capacity
                   for tp, l, j in stages):
                continue
            best = min(best, max(cost.stage_cost(tp, l, j, n, intra).time_s
                                 for tp, l, j in stages))
        return best

    @lru_cache(maxsize=None)
    def best_step(pipes: tuple[tuple[float, int, int], ...], intra: bool) -> float:
        """pipes: (bottleneck, stages, gpus) per pipeline."""
        stages = tuple(s for _, s, _ in pipes)
        best = math.inf
        for ms in _compositions(micro, len(pipes), stages):
            best = min(best, max((m + s - 1) * t for m, (t, s, _) in zip(ms, pipes)))
        return best + cost.grad_sync_s(len(pipes), min(g for _, _, g in pipes), intra)

    nodes = sorted(alive_by_node)
    overall = math.inf
    for choice in itertools.product(*(_node_groupings(alive_by_node[n], sizes)
                                      for n in nodes)):
        groups = [(tp, node) for node, partition in zip(nodes, choice) for tp in partition]
        if not groups:
            continue
        intra = len({node for _, node in groups}) == 1
        seen = set()
        for blocks in _set_partitions(groups):
            key = tuple(sorted(tuple(sorted(b)) for b in blocks))
            if key in seen:
                continue
            seen.add(key)
            options = []
            for block in blocks:
                tps = [tp for tp, _ in block]
                t = min(best_pipeline(order, intra, len(blocks))
                        for order in set(itertools.permutations(tps)))
                options.append((t, len(tps), sum(tps)))
            if any(math.isinf(t) for t, _, _ in options):
                continue
            overall = min(overall, best_step(tuple(sorted(options)), intra))
    return overall


CASES = [
    # (recipe, profile, nodes, gpus per node, dead)
    (TINY, CPU, 2, 4, []),
    (TINY, CPU, 2, 4, [3]),
    (TINY, CPU, 2, 4, [3, 5]),
    (TINY, CPU, 2, 4, [0, 1, 6]),
    (TINY, CPU, 1, 8, [2]),
    (WIDER, TIGHT, 1, 8, []),
    (WIDER, TIGHT, 1, 8, [5]),
    (WIDER, TIGHT, 1, 8, [0, 7]),
    (WIDER, TIGHT, 2, 4, [1]),
    (WIDER, TIGHT, 2, 4, [0, 5, 6]),
    (WIDER, TIGHT, 4, 2, [3]),
    (THIRDS, {**TIGHT, "memory_per_gpu_gib": 0.08}, 1, 8, []),
    (THIRDS, {**TIGHT, "memory_per_gpu_gib": 0.12}, 1, 8, [7]),
    (THIRDS, {**TIGHT, "memory_per_gpu_gib": 0.12}, 1, 8, [6, 7]),
]
# ZeRO-1 with memory so tight that splitting the optimizer state over the pipelines
# changes the optimum (``test_zero1_cases_depend_on_the_split``).
ZERO1_CASES = [
    (WIDER_ZERO1, {**TIGHT, "memory_per_gpu_gib": 0.05}, 1, 8, []),
    (WIDER_ZERO1, {**TIGHT, "memory_per_gpu_gib": 0.05}, 1, 8, [5]),
    (WIDER_ZERO1, {**TIGHT, "memory_per_gpu_gib": 0.05}, 2, 4, [1]),
    (WIDER_ZERO1, {**TIGHT, "memory_per_gpu_gib": 0.05}, 1, 8, [0, 7]),
    (WIDER_ZERO1, {**TIGHT, "memory_per_gpu_gib": 0.035}, 1, 8, []),
    (with_optimizer(WIDER, True, "float32"), {**TIGHT, "memory_per_gpu_gib": 0.06}, 4, 2, [3]),
    (THIRDS_ZERO1, {**TIGHT, "memory_per_gpu_gib": 0.08}, 1, 8, [5]),
    (THIRDS_ZERO1, {**TIGHT, "memory_per_gpu_gib": 0.08}, 2, 4, [1]),
]
# Tighter still: the best pipelines of a packing with fewer pipelines than groups do not
# fit in memory with as many pipelines as groups (the search must size them for the
# packing's own count), and the optimum may be a single pipeline.
ZERO1_TIGHTER_CASES = [
    (WIDER_ZERO1, {**TIGHT, "memory_per_gpu_gib": 0.03}, 1, 8, []),
    (WIDER_ZERO1, {**TIGHT, "memory_per_gpu_gib": 0.035}, 1, 8, [5]),
    (WIDER_ZERO1, {**TIGHT, "memory_per_gpu_gib": 0.035}, 2, 4, [1]),
]


def _case(recipe, profile, nodes, gpn, dead):
    hardware = hardware_from_dict({**profile, "gpus_per_node": gpn}, name="test")
    alive = [g for g in range(nodes * gpn) if g not in dead]
    by_node: dict[int, int] = {}
    for g in alive:
        by_node[g // gpn] = by_node.get(g // gpn, 0) + 1
    sizes = tuple(t for t in recipe.model.valid_tp_sizes if t <= gpn)
    return hardware, alive, by_node, sizes


@pytest.mark.parametrize("recipe,profile,nodes,gpn,dead",
                         CASES + ZERO1_CASES + ZERO1_TIGHTER_CASES)
def test_search_matches_exhaustive_optimum(recipe, profile, nodes, gpn, dead):
    hardware, alive, by_node, sizes = _case(recipe, profile, nodes, gpn, dead)
    result = plan(recipe, hardware, alive, gpus_per_node=gpn)
    assert all(stage.memory.total <= hardware.memory_per_gpu_gib * GIB
               for pipe in result.cost.pipelines for stage in pipe.stages)
    optimum = exhaustive_best(CostModel(recipe, hardware), by_node, sizes)
    # Every case here is a small cluster (<= EXACT_CLUSTER_GPUS alive, <= EXACT_POOL_GROUPS
    # groups), where search.py claims all of its steps exact: equal up to float rounding.
    assert len(alive) <= EXACT_CLUSTER_GPUS and len(alive) <= EXACT_POOL_GROUPS
    assert result.step_s >= optimum * (1 - REL_TOL), "search beat brute force: brute force is wrong"
    assert math.isclose(result.step_s, optimum, rel_tol=REL_TOL), (
        result.layout.describe(), result.step_s, optimum)


@pytest.mark.parametrize("recipe,profile,nodes,gpn,dead", ZERO1_CASES)
def test_zero1_cases_depend_on_the_split(recipe, profile, nodes, gpn, dead):
    """In every ZeRO-1 case the optimum with the optimizer state split over the pipelines
    is faster than with the whole state on every rank, and the plan's layout would not
    fit under the unsplit count: the brute-force comparison above tests the sharded
    count, not a case where memory does not bind."""
    hardware, alive, by_node, sizes = _case(recipe, profile, nodes, gpn, dead)
    cost = CostModel(recipe, hardware)
    unsplit = exhaustive_best(cost, by_node, sizes, count_replicas=False)
    result = plan(recipe, hardware, alive, gpus_per_node=gpn)
    assert result.step_s < unsplit * (1 - 1e-6)
    assert rejected_unsplit(cost, result.layout, hardware.memory_per_gpu_gib * GIB)
