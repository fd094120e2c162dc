"""AdamW as Megatron runs it: fp32 main parameters and gradients, mcore's schedule.

In fp32 the main parameters are the model's own and gradients land in ``.grad``, so
the step is exactly a plain ``torch.optim.AdamW``. With ``params_dtype: bfloat16``
(Megatron's ``--bf16``) the model holds bf16 weights; each parameter gets an fp32 ``main_grad``
buffer that every micro-batch's bf16 gradient is added into (as Megatron's DDP
does), AdamW updates fp32 copies of the weights whose ``.grad`` is that buffer, and
the result is copied back to bf16 (as ``Float16OptimizerWithFloat16Params`` does).
Reduction, the norm and clipping act on ``main_grad`` (``grad_sync.grad_buffer``).

The learning rate and weight decay follow ``training.lr_schedule`` through mcore's
``OptimizerParamScheduler``, stepped like Megatron-LM's loop: by the global batch
after every optimizer step, its lengths counted in samples.

``StageOptimizer`` holds the state of every local parameter; the distributed optimizer
(ZeRO-1, ``runtime/distributed_optimizer.py``) builds on the same pieces here
(``add_main_grad``, ``adamw``, ``lr_scheduler``) for the parts a rank owns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from elastor_mcore.config.recipe import Recipe

if TYPE_CHECKING:
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


def lr_scheduler(optimizer: torch.optim.Optimizer, recipe: Recipe) -> OptimizerParamScheduler:
    """mcore's ``OptimizerParamScheduler`` for ``training.lr_schedule``, built as
    Megatron-LM's ``get_optimizer_param_scheduler`` builds it from its flags."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    training = recipe.training
    schedule = training.lr_schedule
    steps = schedule.scheduler_steps(training.global_batch_size)
    start_wd, end_wd = training.weight_decay_range
    # A constant schedule needs no decay length; mcore still asserts one past the
    # warm-up, and never reads it after the warm-up (nor wd_incr_steps when constant).
    decay = steps["lr_decay_steps"] or steps["lr_warmup_steps"] + 1
    return OptimizerParamScheduler(
        optimizer, init_lr=schedule.lr_warmup_init, max_lr=training.optimizer.lr,
        min_lr=schedule.min_lr, lr_warmup_steps=steps["lr_warmup_steps"],
        lr_decay_steps=decay, lr_decay_style=schedule.lr_decay_style,
        start_wd=start_wd, end_wd=end_wd, wd_incr_steps=steps["wd_incr_steps"] or 0,
        wd_incr_style=schedule.weight_decay_incr_style,
        wsd_decay_steps=steps["wsd_decay_steps"],
        lr_wsd_decay_style=schedule.lr_wsd_decay_style)


STATE_BYTES_PER_ELEMENT = 12
"""fp32 main parameter + AdamW's two fp32 moments."""


def add_main_grad(param: torch.nn.Parameter) -> torch.Tensor:
    """Give ``param`` an fp32 ``main_grad`` laid out like it, into which a hook adds
    each backward's bf16 gradient (Megatron's DDP hook); returns it."""
    param.main_grad = torch.zeros_like(param, dtype=torch.float32)

    def accumulate(p: torch.Tensor) -> None:
        p.main_grad.add_(p.grad)
        p.grad = None

    param.register_post_accumulate_grad_hook(accumulate)
    return param.main_grad


def adamw(recipe: Recipe, decayed: list[torch.Tensor],
          not_decayed: list[torch.Tensor]) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` with the recipe's settings. No weight decay on 1-D tensors
    (norms), as Megatron: ``wd_mult`` 0 keeps it at zero while the scheduler sets the
    decay of the other group."""
    opt = recipe.training.optimizer
    return torch.optim.AdamW(
        [{"params": decayed, "wd_mult": 1.0}, {"params": not_decayed, "wd_mult": 0.0}],
        lr=opt.lr, weight_decay=opt.weight_decay, betas=(opt.adam_beta1, opt.adam_beta2),
        eps=opt.adam_eps)


def state_nbytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors an AdamW holds: its parameters (the fp32 main parameters)
    and their per-parameter state (moments), as allocated now."""
    total = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            total += p.nbytes + sum(v.nbytes for k, v in optimizer.state[p].items()
                                    if k != "step" and torch.is_tensor(v))
    return total


class AdamWState:
    """What checkpoints, the lr schedule and ``--report-memory`` read of an optimizer that
    runs one ``torch.optim.AdamW`` (``self.adamw``) over the fp32 tensors it updates."""

    adamw: torch.optim.AdamW

    @property
    def state(self):
        """AdamW's per-tensor state, keyed by main parameter."""
        return self.adamw.state

    @property
    def param_groups(self) -> list[dict]:
        return self.adamw.param_groups

    @property
    def lr(self) -> float:
        """The learning rate of the next step."""
        return self.adamw.param_groups[0]["lr"]

    def state_nbytes(self) -> int:
        """Bytes of fp32 main parameters (in fp32 runs, the weights themselves) and
        moments this rank holds."""
        return state_nbytes(self.adamw)


class StageOptimizer(AdamWState):
    """One rank's AdamW over fp32 main parameters, with its lr schedule."""

    def __init__(self, model: torch.nn.Module, recipe: Recipe) -> None:
        self.recipe = recipe
        self.params = list(model.parameters())
        self.mixed = recipe.training.params_dtype != "float32"
        self._main = {}
        for p in self.params:
            self._main[p] = self._main_copy(p) if self.mixed else p
        main = [self._main[p] for p in self.params]
        self.adamw = adamw(recipe, [m for m in main if m.dim() > 1],
                           [m for m in main if m.dim() <= 1])
        self.scheduler = lr_scheduler(self.adamw, recipe)

    @staticmethod
    def _main_copy(param: torch.nn.Parameter) -> torch.Tensor:
        """fp32 copy of ``param`` laid out like it; its ``.grad`` is ``param.main_grad``."""
        main = torch.empty_like(param, dtype=torch.float32).copy_(param.detach())
        main.grad = add_main_grad(param)
        return main

    def main_param(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The fp32 tensor AdamW updates for ``param`` (``param`` itself in fp32 runs)."""
        return self._main[param]

    def expected_state_nbytes(self) -> float:
        """The formula: 12 bytes (fp32 main + two moments) per local parameter."""
        return float(STATE_BYTES_PER_ELEMENT * sum(p.numel() for p in self.params))

    def zero_grad(self) -> None:
        if not self.mixed:
            self.adamw.zero_grad(set_to_none=False)
            return
        for p in self.params:
            p.main_grad.zero_()
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on the main parameters, copy them to the model, advance the schedule."""
        self.adamw.step()
        self.copy_main_to_model()
        self.scheduler.step(increment=self.recipe.training.global_batch_size)

    @torch.no_grad()
    def copy_main_to_model(self) -> None:
        """Round the fp32 main parameters into the bf16 weights (after a step or a load)."""
        if self.mixed:
            for p in self.params:
                p.copy_(self._main[p])
