"""``--use-distributed-optimizer`` on a heterogeneous layout: Elastor's ZeRO-1 behind
Megatron's optimizer interface.

Megatron's own distributed optimizer shards the state over a rank's data-parallel
group, i.e. its exact replicas; on a heterogeneous layout a stage's weights are also
held by ranks of other pipelines (a TP1 rank holds both halves a TP2 pair splits), so
it would keep one copy of the state per pipeline shape. ``ZeroShards``
(``runtime/distributed_optimizer.py``) shards every piece of every weight over all its
holders, whatever their pipelines: each element's fp32 main parameter and moments live
once in the job.

``ZeroMegatronOptimizer`` is what Megatron-LM's loop calls (``zero_grad``, ``step``,
``param_groups`` for its lr schedule, ``sharded_state_dict`` / ``load_state_dict`` for
checkpoints, ``reload_model_params``). It keeps Megatron's torch optimizer and its param
groups (lr and weight-decay multipliers as Megatron assigned them), with each group's
parameters replaced by the owned fp32 fragments of that group's weights. The gradient
reduction, the division by the global batch's tokens and the norm happen in the hooked
schedule (``training._finalize_grads``), on the owned segments; ``step`` clips by that
norm as Megatron's ``clip_grad_by_total_norm_fp32`` does, steps, and all-gathers the
weights (under ``--overlap-param-gather`` it only starts the all-gathers, which the next
forward waits for module by module: ``overlap.ParamGather``).

Checkpoints are Megatron's ``fully_reshardable`` distributed-optimizer format, keyed by
model tensor (``optimizer.state.param|exp_avg|exp_avg_sq.<key>``) in model space; each
rank saves the boxes it owns (an irregular grid: ``axis_fragmentations`` None), so a
checkpoint of this optimizer resumes under Megatron's distributed optimizer on a uniform
layout and the other way round.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch

from elastor_mcore.runtime.distributed_optimizer import ZeroShards
from elastor_mcore.runtime.state import ADAM_MOMENTS, ensure_optimizer_state

log = logging.getLogger(__name__)

SHARDING_TYPE = "fully_reshardable"
STATE_PREFIX = "optimizer.state"
MAIN_PARAM = "param"
"""The fully reshardable format's name for the fp32 main parameter."""


def _megatron_optimizer_base():
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    return MegatronOptimizer


def uncopied_config(config):
    """Megatron's optimizer config for the optimizer ``zero_megatron_optimizer`` takes:
    neither distributed nor mixed precision, so that Megatron builds its plain
    ``FP32Optimizer`` over the model's own weights (its param groups, lr and
    weight-decay multipliers, torch optimizer) and no fp32 copy of them: with
    ``bf16`` its ``Float16OptimizerWithFloat16Params`` would copy every weight of the
    rank to fp32 (4 bytes per parameter, kept as ``param.main_param``) before ZeRO-1
    takes its shard."""
    return dataclasses.replace(config, use_distributed_optimizer=False, bf16=False,
                               fp16=False)


def zero_megatron_optimizer(built, config, shards: ZeroShards, norm: Callable[[], float],
                            gather_weights: Callable[[], None] | None = None):
    """Megatron's optimizer ``built`` with ``uncopied_config`` for the same model, turned
    into a ``ZeroMegatronOptimizer`` over ``shards`` with Megatron's optimizer
    ``config``; ``norm()`` is this step's global gradient norm; ``gather_weights`` runs
    after each step (default: ``shards.copy_main_to_model``, all-gathered at once)."""
    chained = getattr(built, "chained_optimizers", [built])
    if len(chained) != 1:
        raise RuntimeError(f"Megatron built {len(chained)} optimizers; ZeRO-1 on a "
                           f"heterogeneous layout takes one (a dense model)")
    megatron = chained[0]
    if hasattr(megatron, "float16_groups"):
        raise RuntimeError("Megatron built a mixed-precision optimizer, i.e. fp32 copies "
                           "of the rank's whole model; build it with uncopied_config(config)")
    inner = megatron.optimizer
    group_of = {id(w): index for index, group in enumerate(inner.param_groups)
                for w in group["params"]}
    owned: list[list[torch.Tensor]] = [[] for _ in inner.param_groups]
    local = shards.plan.refinement.local
    for fragment, main in shards.owned_mains():
        owned[group_of[id(local[fragment.cell.key].param)]].append(main)
    for group, mains in zip(inner.param_groups, owned):
        group["params"] = mains
    inner.state.clear()
    return ZeroMegatronOptimizer(inner, config, shards, norm,
                                 gather_weights or shards.copy_main_to_model)


def checkpoint_grid(shards: ZeroShards) -> dict[str, list[list[int]]]:
    """Per key of the state ``ZeroMegatronOptimizer.sharded_state_dict`` saves, the
    cut points its files are chosen from (``ZeroShards.file_grid``): each rank then
    writes and reads its own boxes with no owner planning them
    (``checkpoint.Replicas.grid``)."""
    return {f"{STATE_PREFIX}.{name}.{key}": cuts for key, cuts in shards.file_grid().items()
            for name in (MAIN_PARAM, *ADAM_MOMENTS)}


class ZeroMegatronOptimizer(_megatron_optimizer_base()):
    """Megatron's ``MegatronOptimizer`` interface over ``ZeroShards`` (see the module)."""

    def __init__(self, inner: torch.optim.Optimizer, config, shards: ZeroShards,
                 norm: Callable[[], float], gather_weights: Callable[[], None]) -> None:
        super().__init__(inner, config)
        self.shards = shards
        self._norm = norm
        self._gather_weights = gather_weights
        self.is_stub_optimizer = False
        device = shards.owned_grads()[0].device if shards.owned_grads() else "cpu"
        self._one = torch.ones(1, dtype=torch.float32, device=device)

    def _weights(self) -> list[torch.nn.Parameter]:
        return [piece.param for piece in self.shards.plan.refinement.local.values()]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """DDP's ``zero_grad_buffer`` clears ``main_grad``; the owned segments are
        overwritten by every reduction."""
        for weight in self._weights():
            weight.grad = None

    def get_loss_scale(self) -> torch.Tensor:
        return self._one

    @torch.no_grad()
    def reload_model_params(self, state_dict=None) -> None:
        """The owned main parameters from the weights (a load without optimizer state)."""
        self.shards.copy_model_to_main()

    def prepare_grads(self) -> bool:
        """The owned gradients are ready after the hooked schedule's reduction."""
        return False

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        self.optimizer.step()
        self._gather_weights()
        return True

    @torch.no_grad()
    def step(self):
        """Clip the owned gradients by the global norm (Megatron's rule), step, gather
        the weights: ``(update_successful, grad_norm, num_zeros_in_grad)``."""
        norm = self._norm()
        clip = self.config.clip_grad
        if clip > 0 and clip / (norm + 1.0e-6) < 1.0:
            self.shards.scale_(clip / (norm + 1.0e-6))
        return self.step_with_ready_grads(), norm, None

    # ------------------------------------------------------------------ checkpoints

    def _step_count(self) -> int:
        steps = {int(s["step"]) for s in self.optimizer.state.values() if "step" in s}
        if len(steps) > 1:
            raise RuntimeError(f"owned parameters disagree on the Adam step: {sorted(steps)}")
        return steps.pop() if steps else 0

    def state_dict(self) -> dict:
        """The non-tensor state, shaped as Megatron's distributed optimizer saves it."""
        step = self._step_count()
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "step": step}
                  for g in self.optimizer.param_groups]
        return {"optimizer": {"param_groups": groups}}

    def load_state_dict(self, state_dict: dict) -> None:
        """Adam's step from the checkpoint's param groups; the tensors, loaded into the
        owned state by ``sharded_state_dict(is_loading=True)``'s tensors."""
        ensure_optimizer_state(self.optimizer)
        steps = {g["step"] for g in state_dict["optimizer"]["param_groups"] if "step" in g}
        if len(steps) != 1:
            raise RuntimeError(f"the checkpoint's optimizer param groups carry steps "
                               f"{sorted(steps)}; expected one")
        step = float(steps.pop())
        for state in self.optimizer.state.values():
            state["step"].fill_(step)
        mains = self.shards.owned_mains()
        for index, tensors in state_dict.get("param_state", {}).items():
            for name, target in self._owned_tensors(mains[int(index)][1]).items():
                if tensors[name] is not target:
                    target.copy_(tensors[name])

    def _owned_tensors(self, main: torch.Tensor) -> dict[str, torch.Tensor]:
        state = self.optimizer.state[main]
        return {MAIN_PARAM: main, **{name: state[name] for name in ADAM_MOMENTS}}

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading: bool = False,
                           metadata: dict | None = None) -> dict:
        """Each owned fragment's main parameter and moments as ShardedTensors of the
        model tensor's global array (the fully reshardable format's keys)."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        sharding = (metadata or {}).get("distrib_optim_sharding_type", SHARDING_TYPE)
        if sharding != SHARDING_TYPE:
            raise RuntimeError(
                f"distributed-optimizer checkpoints of a heterogeneous layout are saved "
                f"'{SHARDING_TYPE}', not '{sharding}': pass "
                f"--dist-ckpt-optim-fully-reshardable")
        ensure_optimizer_state(self.optimizer)
        shapes = self.shards.plan.refinement.shapes
        param_state = {}
        for index, (fragment, main) in enumerate(self.shards.owned_mains()):
            key, box = fragment.cell.key, fragment.box
            param_state[index] = {
                name: ShardedTensor(f"{STATE_PREFIX}.{name}.{key}", tensor, tensor.dtype,
                                    tuple(box.shape), tuple(shapes[key]), tuple(box.offset),
                                    None, replica_id=0)
                for name, tensor in self._owned_tensors(main).items()}
        return {**self.state_dict(), "param_state": param_state,
                "param_state_sharding_type": SHARDING_TYPE}
