"""``--elastor-report-memory``: the memory Megatron-LM's loop uses on each rank under
``--elastor-layout``, measured on its tensors, beside what the planner predicts for
the rank's stage (``elastor train --report-memory``'s table, ``runtime/memory.py``).

The second training step is measured (the first optimizer step has allocated Adam's
state by then): weights, the DDP ``main_grad`` buffers, Megatron's optimizer state
(fp32 main parameters where they are copies, and the moments; ZeRO-1's owned shards on
a heterogeneous layout), the peak bytes autograd saved for backward during the step,
and the process's RSS high-water (on GPUs the CUDA allocator's peak, and Megatron-LM's
own ``report_memory`` line beside). The prediction is the cost model's for the recipe
the arguments translate to (``translate.recipe_from_args``: sequence parallelism,
recompute, the distributed optimizer) on ``--elastor-hardware`` (default on CPU: the
shipped CPU profile; none on GPUs: no prediction).

Start-up is reported beside it: the tensors allocated while the optimizer was built,
at their peak and kept (``memory.AllocationMeter``, ``wrap_get_optimizer``), and the
RSS high-water then; the step's own RSS high-water is measured from a reset at its
start (``memory.reset_rss_high_water``), so the two phases' peaks compare.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable

import torch
import torch.distributed as dist

from elastor_mcore import planner
from elastor_mcore.config.recipe import Recipe
from elastor_mcore.parallel.groups import RankGroups
from elastor_mcore.planner.cost_model import MemoryBreakdown
from elastor_mcore.runtime import memory
from elastor_mcore.runtime.grad_sync import grad_buffer
from elastor_mcore.runtime.train import CPU_PROFILE

log = logging.getLogger(__name__)

MEASURED_STEP = 2
"""The training step measured: after the first optimizer step, Adam's state exists."""


@dataclasses.dataclass
class MemoryReport:
    """One process's report (measured once, at ``MEASURED_STEP``)."""

    hardware: str | None
    """A hardware profile for the prediction (None: the CPU profile on CPU, else none)."""
    optimizer: Any = None
    """Megatron-LM's optimizer (``train`` hands it over)."""
    startup: memory.StartupMemory | None = None
    """Measured as the optimizer was built (None: not measured)."""
    steps: int = 0
    done: bool = False

    def wrap(self, forward_backward: Callable, groups: RankGroups | None,
             recipe: Callable[[], Recipe]) -> Callable:
        """``forward_backward``, measured at ``MEASURED_STEP``."""
        if self.done:
            return forward_backward

        @functools.wraps(forward_backward)
        def measured(*args, forward_only: bool = False, **kwargs):
            if forward_only:
                return forward_backward(*args, forward_only=forward_only, **kwargs)
            self.steps += 1
            if self.steps != MEASURED_STEP:
                return forward_backward(*args, **kwargs)
            from megatron.core.utils import unwrap_model

            model = kwargs["model"]
            chunks = model if isinstance(model, list) else [model]
            modules = [unwrap_model(c) for c in chunks]
            meter = memory.SavedTensorMeter(torch.nn.ModuleList(modules))
            with meter, memory.PhaseHighWater() as rss:
                result = forward_backward(*args, **kwargs)
            self.done = True
            self._report(modules, meter.peak, groups, recipe, rss)
            return result
        return measured

    def _report(self, modules: list[torch.nn.Module], activations_peak: int,
                groups: RankGroups | None, recipe: Callable[[], Recipe],
                rss: memory.PhaseHighWater) -> None:
        model = torch.nn.ModuleList(modules)
        measured = memory.measure(model, _inner_optimizers(self.optimizer)[0],
                                  [grad_buffer(p) for p in model.parameters()],
                                  activations_peak)
        for extra in _inner_optimizers(self.optimizer)[1:]:
            more = memory.measure(model, extra, [], 0)
            measured = dataclasses.replace(measured,
                                           optimizer=measured.optimizer + more.optimizer)
        device = next(model.parameters()).device
        pos = groups.position
        mine = memory.RankMemory(
            groups.rank, f"P{pos.pipeline}.S{pos.stage}.tp{pos.tp_rank}", measured,
            rss.process, memory.device_peak_bytes(device),
            self._predicted(recipe(), groups, device), self.startup, rss.phase)
        reports: list = [None] * dist.get_world_size(groups.active)
        dist.all_gather_object(reports, mine, group=groups.active)
        if device.type == "cuda":
            from megatron.training.utils import report_memory

            report_memory(f"(elastor: step {MEASURED_STEP})")
        if groups.rank == min(groups.layout.ranks):
            reports.sort(key=lambda r: r.rank)
            when = f"training step {MEASURED_STEP}"
            for line in (*memory.memory_table(reports, f"in {when}"),
                         *memory.startup_table(reports, when)):
                log.info("%s", line)

    def _predicted(self, recipe: Recipe, groups: RankGroups, device: torch.device
                   ) -> MemoryBreakdown | None:
        path = self.hardware or (str(CPU_PROFILE) if device.type == "cpu" else None)
        if path is None:
            return None
        profile = planner.load_hardware(path)
        pos = groups.position
        cost = planner.layout_cost(planner.CostModel(recipe, profile), groups.layout,
                                   profile.gpus_per_node)
        return dataclasses.replace(cost.pipelines[pos.pipeline].stages[pos.stage].memory,
                                   reserved=0.0)


def _inner_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers behind Megatron's (chained or not)."""
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o.optimizer for o in chained]
