"""Layout planner: the fastest layout for the GPUs that are alive.

``plan(recipe, hardware, alive_gpus)`` searches (``search``) under the analytic cost
model (``cost_model``) and returns a :class:`Plan`: a :class:`~elastor_mcore.parallel.layout.Layout`
whose ranks are physical GPU ids (``node * gpus_per_node + local id``), validated
against the recipe, with its predicted step time, per-stage costs and memory per GPU.
Pure and deterministic: no torch, no process groups, so the elastic supervisor can call
it between two runs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from elastor_mcore.parallel.layout import Layout, layout_from_dict
from elastor_mcore.planner.cost_model import GIB, CostModel, StepCost
from elastor_mcore.planner.calibration import measured_step_s
from elastor_mcore.planner.hardware import (HardwareError, HardwareProfile, hardware_from_dict,
                                            load_hardware, write_hardware)
from elastor_mcore.planner.search import Candidate, search
from elastor_mcore.config.recipe import Recipe

__all__ = ["Plan", "PlannerError", "HardwareError", "HardwareProfile", "CostModel",
           "plan", "load_hardware", "hardware_from_dict", "write_hardware", "layout_cost",
           "measured_step_s", "predicted_step_s"]

log = logging.getLogger(__name__)


class PlannerError(ValueError):
    """No layout can run on the given GPUs; the message says what is missing."""


@dataclass(frozen=True)
class Plan:
    layout: Layout
    """Ranks are physical GPU ids."""
    cost: StepCost
    """Per pipeline and stage: times and memory; ``cost.step_s`` is the predicted step."""
    gpus_per_node: int
    alive_gpus: tuple[int, ...]

    @property
    def step_s(self) -> float:
        return self.cost.step_s

    @property
    def idle_gpus(self) -> tuple[int, ...]:
        used = set(self.layout.ranks)
        return tuple(g for g in self.alive_gpus if g not in used)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary: the layout and what the cost model predicts for it."""
        stages = []
        for p, (pipe, pcost) in enumerate(zip(self.layout.pipelines, self.cost.pipelines)):
            for s, (stage, scost) in enumerate(zip(pipe.stages, pcost.stages)):
                mem = scost.memory
                stages.append({
                    "pipeline": p, "stage": s, "tp": stage.tp, "layers": stage.layers,
                    "gpus": list(stage.ranks), "time_s": scost.time_s,
                    "compute_s": scost.compute_s, "tp_comm_s": scost.tp_comm_s,
                    "p2p_s": scost.p2p_s, "tp_comm_bytes": scost.tp_comm_bytes,
                    "p2p_bytes": scost.p2p_bytes,
                    "memory_gib": {"weights": mem.weights / GIB, "gradients": mem.gradients / GIB,
                                   "optimizer": mem.optimizer / GIB,
                                   "activations": mem.activations / GIB,
                                   "reserved": mem.reserved / GIB, "total": mem.total / GIB}})
        return {"layout": self.layout.to_dict(), "step_s": self.step_s,
                "pipeline_s": [p.time_s for p in self.cost.pipelines],
                "grad_sync_s": self.cost.grad_sync_s, "stages": stages,
                "gpus_used": self.layout.num_gpus, "idle_gpus": list(self.idle_gpus)}


def layout_cost(cost: CostModel, layout: Layout, gpus_per_node: int) -> StepCost:
    """Predicted cost of any layout whose ranks are physical GPU ids."""
    intra = len({r // gpus_per_node for r in layout.ranks}) == 1
    return cost.step_cost(
        [(p.micro_batches, [(s.tp, s.layers) for s in p.stages]) for p in layout.pipelines],
        intra_node=intra)


def predicted_step_s(recipe: Recipe, hardware: HardwareProfile, layout: Layout,
                     slots: Iterable[int] | None = None) -> float:
    """The cost model's step time for ``layout``; ``slots`` maps its ranks to physical
    GPU ids (default: the ranks are the ids), which decides whether it spans nodes."""
    if slots is not None:
        ids = tuple(slots)
        data = layout.to_dict()
        for pipe in data["pipelines"]:
            for stage in pipe["stages"]:
                stage["ranks"] = [ids[r] for r in stage["ranks"]]
        layout = layout_from_dict(data)
    return layout_cost(CostModel(recipe, hardware), layout, hardware.gpus_per_node).step_s


def _place(candidate: Candidate, alive_by_node: dict[int, list[int]],
           gpus_per_node: int) -> Layout:
    """Give each stage a concrete group, keeping a pipeline's stages on one node when
    a group of the right size is left there."""
    free: dict[int, list[tuple[int, ...]]] = {}
    for node, partition in candidate.partitions:
        ids = alive_by_node[node]
        start = 0
        for tp in partition:
            free.setdefault(tp, []).append(
                tuple(node * gpus_per_node + i for i in ids[start:start + tp]))
            start += tp
    pipelines = []
    ordered = sorted(candidate.pipelines, key=lambda sm: (-sm[0].gpus, sm[0].tps, -sm[1]))
    for shape, micro in ordered:
        stages, node = [], None
        for tp, layers in zip(shape.tps, shape.layers):
            pool = free[tp]
            pick = next((i for i, g in enumerate(pool) if g[0] // gpus_per_node == node), 0)
            ranks = pool.pop(pick)
            node = ranks[0] // gpus_per_node
            stages.append({"tp": tp, "layers": layers, "ranks": list(ranks)})
        pipelines.append({"micro_batches": micro, "stages": stages})
    return layout_from_dict({"pipelines": pipelines})


def plan(recipe: Recipe, hardware: HardwareProfile, alive_gpus: Iterable[int],
         gpus_per_node: int | None = None, tp_sizes: Iterable[int] | None = None,
         sequence_parallel: bool | None = None, use_all: bool = False) -> Plan:
    """Fastest layout of ``recipe`` on ``alive_gpus`` (physical ids) under the cost model.

    ``tp_sizes`` restricts the TP degrees tried (default: every degree the model allows
    that fits in a node; with a profile measured for the recipe, the degrees measured).
    ``sequence_parallel`` defaults to the recipe's ``training.sequence_parallel``.
    ``use_all`` keeps every alive GPU busy when some layout can (CPU slots that stand for
    GPUs: on fewer cores than slots the fastest layout would leave slots idle). Raises
    PlannerError when nothing fits.
    """
    gpn = gpus_per_node or hardware.gpus_per_node
    alive = tuple(sorted(set(alive_gpus)))
    if not alive:
        raise PlannerError("no GPU is alive: alive_gpus is empty")
    if min(alive) < 0:
        raise PlannerError(f"alive_gpus: {min(alive)} is not a GPU id (ids are >= 0)")
    cost = CostModel(recipe, hardware, sequence_parallel=sequence_parallel)
    measured = cost.measured_tp_sizes
    sizes = tuple(t for t in recipe.model.valid_tp_sizes if t <= gpn
                  and (tp_sizes is None or t in set(tp_sizes))
                  and (measured is None or t in measured))
    if not sizes:
        if measured is not None:
            raise PlannerError(
                f"the hardware profile {hardware.name} measured {recipe.name} at TP "
                f"{list(measured)} only, none of them allowed here (tp_sizes "
                f"{sorted(tp_sizes or [])}, {gpn} GPUs per node); run elastor profile with "
                f"the TP degrees you need")
        raise PlannerError(
            f"tp_sizes: none of {sorted(tp_sizes or [])} divides the model's heads, query "
            f"groups and FFN width; allowed are {recipe.model.valid_tp_sizes}")
    by_node: dict[int, list[int]] = {}
    for g in alive:
        by_node.setdefault(g // gpn, []).append(g % gpn)
    alive_by_node = {n: len(ids) for n, ids in by_node.items()}
    best = search(cost, alive_by_node, sizes, min_gpus=len(alive)) if use_all else None
    if best is None:
        best = search(cost, alive_by_node, sizes)
    if best is None:
        raise PlannerError(_infeasible_message(cost, recipe, len(alive), sizes))
    layout = _place(best, by_node, gpn)
    layout.validate(recipe)
    return Plan(layout=layout, cost=layout_cost(cost, layout, gpn), gpus_per_node=gpn,
                alive_gpus=alive)


def _size(nbytes: float) -> str:
    """Bytes for a message: GiB, or MiB below one GiB (small models, CPU slots)."""
    if abs(nbytes) >= GIB:
        return f"{nbytes / GIB:.1f} GiB"
    return f"{nbytes / 2**20:.1f} MiB"


def _infeasible_message(cost: CostModel, recipe: Recipe, alive: int,
                        sizes: tuple[int, ...]) -> str:
    """Say how much memory is missing: model states plus one micro-batch of activations."""
    tp = max(sizes)
    one_layer = cost.layer_memory_bytes(tp, 0, 1) * tp
    ends = (cost.stage_memory(tp, 0, 0, 1).total - cost.stage_memory(tp, 0, 0, 1).reserved) * tp
    needed = recipe.model.num_layers * one_layer + ends
    available = alive * cost.capacity_bytes
    if needed > available:
        return (f"{recipe.name} does not fit on {alive} alive GPUs: it needs at least "
                f"{_size(needed)} (weights, gradients, optimizer state and one "
                f"micro-batch of activations) but they offer {_size(available)} "
                f"after the reserved memory; {_size(needed - available)} are "
                f"missing. Add GPUs, use GPUs with more memory, or a smaller model.")
    return (f"{recipe.name} has no layout on {alive} alive GPUs: their {_size(available)} "
            f"cover the {_size(needed)} of model states and activations in total, "
            f"but no pipeline of at most {recipe.model.num_layers} stages with TP sizes "
            f"{list(sizes)} within a node fits each stage into "
            f"{_size(cost.capacity_bytes)} with 1F1B's in-flight activations and "
            f"at least as many micro-batches ({cost.total_micro_batches}) as stages. Add "
            f"GPUs per node or use GPUs with more memory.")
