"""What stock Megatron can do with the same GPUs: the best uniform layout.

Megatron needs one TP degree, one stage count with equal layers per stage, and equal
micro-batches per pipeline (``dp`` divides the global batch's micro-batches). With dead
GPUs it runs on the subset that hosts ``dp x pp`` whole TP groups; we report the fastest
such layout under the same cost model as the planner, so the two are comparable.
"""

from __future__ import annotations

from collections.abc import Iterable

from elastor_mcore.parallel.layout import layout_from_dict
from elastor_mcore.planner import Plan, PlannerError, layout_cost
from elastor_mcore.planner.cost_model import CostModel
from elastor_mcore.planner.hardware import HardwareProfile
from elastor_mcore.config.recipe import Recipe


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def best_uniform(recipe: Recipe, hardware: HardwareProfile, alive_gpus: Iterable[int],
                 gpus_per_node: int | None = None, tp_sizes: Iterable[int] | None = None,
                 sequence_parallel: bool | None = None) -> Plan:
    """Fastest ``dpX-tpY-ppZ`` layout the alive GPUs can host; PlannerError if none fits."""
    gpn = gpus_per_node or hardware.gpus_per_node
    alive = tuple(sorted(set(alive_gpus)))
    by_node: dict[int, list[int]] = {}
    for g in alive:
        by_node.setdefault(g // gpn, []).append(g)
    cost = CostModel(recipe, hardware, sequence_parallel=sequence_parallel)
    layers, micro = recipe.model.num_layers, recipe.training.total_micro_batches
    best: tuple[float, int, Plan] | None = None
    for tp in recipe.model.valid_tp_sizes:
        if tp > gpn or (tp_sizes is not None and tp not in set(tp_sizes)):
            continue
        groups = [tuple(ids[i:i + tp]) for ids in by_node.values()
                  for i in range(0, len(ids) - tp + 1, tp)]
        for pp in _divisors(layers):
            per_stage = layers // pp
            for dp in _divisors(micro):
                if dp * pp > len(groups) or micro // dp < pp:
                    continue
                if any(cost.stage_memory(tp, per_stage, j, pp, replicas=dp).total
                       > hardware.memory_per_gpu_gib * 1024**3 for j in range(pp)):
                    continue  # ZeRO-1: the optimizer state split over the dp pipelines
                it = iter(groups)
                layout = layout_from_dict({"pipelines": [
                    {"micro_batches": micro // dp,
                     "stages": [{"tp": tp, "layers": per_stage, "ranks": list(next(it))}
                                for _ in range(pp)]}
                    for _ in range(dp)]})
                step = layout_cost(cost, layout, gpn)
                key = (step.step_s, layout.num_gpus)
                if best is None or key < best[:2]:
                    best = (*key, Plan(layout=layout, cost=step, gpus_per_node=gpn,
                                       alive_gpus=alive))
    if best is None:
        raise PlannerError(
            f"no uniform Megatron layout of {recipe.name} fits on the {len(alive)} alive GPUs")
    return best[2]
