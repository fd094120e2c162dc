"""Megatron-LM's training loop on heterogeneous layouts (per-stage TP, pipelines of
different shapes or micro-batch counts).

Megatron-LM's loop assumes identical pipelines: one TP degree per pipeline, every
pipeline running ``get_num_microbatches()`` micro-batches, the data-parallel group
reducing gradients and losses, the data sampler splitting every batch evenly over
that group. Under a layout Megatron-LM cannot train (``Layout.is_uniform`` false),
the replacements here (``hooks.PATCHES`` lists them in run order with the others; their
state is the process's ``Installation``) replace exactly those parts and leave the rest
of the loop (arguments, model provider, ``forward_step_func`` and its loss function,
optimizer, lr schedule, logging, checkpoints) as it is:

* **Schedule.** ``get_forward_backward_func`` returns ``forward_backward``: Elastor's
  1F1B (``runtime/schedule.py``) over the layout's micro-batch count of this rank's
  pipeline, with Elastor's P2P between stages of different TP (``runtime/p2p.py``).
  Each micro-batch runs Megatron's ``forward_step_func``; on a last stage its loss
  function gives the token sum, the token count and the report. The backward pass
  uses the token sum, and the gradients are divided by the token count of the whole
  global batch afterwards (Megatron's ``--calculate-per-token-loss`` arithmetic), so
  every token of the global batch weighs the same whichever pipeline trained it.
* **Sequence parallelism.** Stages of TP > 1 split their activations' rows over TP;
  the P2P re-splits them at each boundary (``runtime/p2p.py``) and the norms'
  gradients are summed over the TP group (``grad_sync.SequenceParallelGrads``).
* **Gradient finalisation.** DDP's ``main_grad`` buffers are summed across pipelines by
  ``runtime/grad_sync.py`` (cells of the common refinement of all ranks' shards, each
  stage counting once, so a tied embedding's first- and last-stage gradients add)
  instead of DDP's data-parallel all-reduce, then scaled by ``1 / tokens``: after the
  last backward, or under ``--overlap-grad-reduce`` bucket by bucket during it
  (``overlap.py``, which also overlaps ZeRO-1's all-gather with the next forward under
  ``--overlap-param-gather``).
* **Gradient norm.** The global norm (every element of every global tensor once) is
  computed once over all active ranks after the reduction; the optimizer's
  ``get_grad_norm_fp32`` returns it, so every replica clips by the same factor and a
  NaN or Inf norm stops every rank at the same step.
* **Reported loss.** The last stages' reports are summed over every pipeline, so the
  loss Megatron-LM logs is that of the whole global batch (Megatron divides the
  summed ``[loss, tokens]`` pair, which the data-parallel sum it still does leaves
  unchanged).
* **Data.** ``build_pretraining_data_loader`` gives each pipeline its slice of every
  global batch (``data/samples.py``: samples ``k*G ... k*G+G-1`` for batch ``k``, cut
  in proportion to the micro-batch counts), starting at the consumed samples.
* **Bookkeeping.** Megatron counts a step's samples as data-parallel size x micro-batch
  size x ``get_num_microbatches()``. Its data-parallel group is the rank's exact
  replicas, so ``args.adapt_args`` sets ``args.data_parallel_size`` to that group's
  size and the micro-batch calculator to the matching count: consumed samples and the lr
  schedule then advance by the global batch on every rank.
* **Model config.** At core_r0.19.0 ``pretrain_gpt.py`` builds the model config before
  the parallel state exists; under any layout it is rebuilt from this rank's adapted
  arguments before the model is (``wrap_setup_model``).

* **Initial weights.** Megatron seeds each pipeline stage's initialisation by its
  pipeline rank, so pipelines of different shapes start with different values of the
  layers they share; once the model is built, every replica takes its lowest-ranked
  holder's values (``grad_sync.broadcast_replicas``), as the optimizer is built.
* **Distributed optimizer.** ``--use-distributed-optimizer`` shards the optimizer
  state with Elastor's ZeRO-1 over every holder of each piece of each weight, across
  pipelines of any shape (``zero_optimizer.py``), instead of Megatron's, which would
  shard it over exact replicas only. The schedule's reduction then reduce-scatters into
  each rank's owned segments, and the optimizer all-gathers the updated weights. Its
  checkpoints are Megatron's fully reshardable format (``optimizer.state.param.*`` etc.
  in model space, any layout).

Evaluation runs the same forward steps without backward (``forward_only``).
Everything else (what Megatron-LM's loop cannot do under such a layout) is refused
before training by ``unsupported_reason``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from elastor_mcore.data.samples import pipeline_sample_indices
from elastor_mcore.integrations.megatron_lm import zarr_format
from elastor_mcore.integrations.megatron_lm.installation import Installation, ScheduleState
from elastor_mcore.integrations.megatron_lm.memory_report import MemoryReport
from elastor_mcore.integrations.megatron_lm.overlap import (
    GradReadiness, ParamGather, key_position, serve_param_sync, tp_replicated)
from elastor_mcore.integrations.megatron_lm.translate import is_heterogeneous, recipe_from_args
from elastor_mcore.parallel.groups import RankGroups, replica_ranks
from elastor_mcore.parallel.layout import Layout
from elastor_mcore.runtime import memory
from elastor_mcore.runtime.distributed_optimizer import ShardPlan, ZeroShards
from elastor_mcore.runtime.grad_sync import (GradientSynchronizer, SequenceParallelGrads,
                                             backward_order, broadcast_replicas)
from elastor_mcore.runtime.p2p import StageCommunicator, stage_links
from elastor_mcore.runtime.schedule import run_1f1b

log = logging.getLogger(__name__)


def unsupported_reason(layout: Layout, args) -> str | None:
    """Why Megatron-LM's loop cannot train the heterogeneous ``layout`` with ``args``
    (None: it can). Checked before any rank starts training."""
    if getattr(args, "use_distributed_optimizer", False) and not getattr(
            args, "dist_ckpt_optim_fully_reshardable", False):
        return ("--use-distributed-optimizer on a heterogeneous layout needs "
                "--dist-ckpt-optim-fully-reshardable: Megatron's other formats key the "
                "optimizer state by gradient bucket, whose shapes differ between stages, so "
                "no checkpoint could be saved; add --dist-ckpt-optim-fully-reshardable")
    if getattr(args, "fp16", False):
        return ("--fp16 on a heterogeneous layout: the loss-scaler's inf check would "
                "only cover one pipeline; use --bf16")
    if getattr(args, "context_parallel_size", 1) != 1:
        return "--context-parallel-size > 1 on a heterogeneous layout: drop it"
    if getattr(args, "mtp_num_layers", None):
        return ("--mtp-num-layers on a heterogeneous layout: multi-token prediction's "
                "separate gradient norm is not reduced across pipelines; drop it")
    if getattr(args, "num_experts", None):
        return ("--num-experts on a heterogeneous layout: MoE layers are not supported "
                "there; train a dense model")
    if getattr(args, "rampup_batch_size", None):
        return ("--rampup-batch-size on a heterogeneous layout: the micro-batch counts "
                "are the layout's; drop it")
    if getattr(args, "dataloader_type", "single") not in (None, "single"):
        return (f"--dataloader-type {args.dataloader_type} on a heterogeneous layout: "
                f"each pipeline reads its slice of the global batch in order; use "
                f"--dataloader-type single")
    for flag, attr, train_value in (
            ("--eval-micro-batch-size", "eval_micro_batch_size", args.micro_batch_size),
            ("--eval-global-batch-size", "eval_global_batch_size", args.global_batch_size)):
        if getattr(args, attr, None) not in (None, train_value):
            return (f"{flag} {getattr(args, attr)} on a heterogeneous layout: evaluation "
                    f"runs the layout's micro-batches, like training; drop {flag}")
    last = max(layout.ranks)
    pos = layout.position(last)
    if pos.stage != len(layout.pipelines[pos.pipeline].stages) - 1:
        return (f"rank {last} (the highest) holds stage {pos.stage} of pipeline "
                f"{pos.pipeline}, not a last stage: Megatron-LM logs the loss from the "
                f"highest rank; give it a last stage (e.g. leave 'ranks' out of the layout)")
    mbs, gbs = args.micro_batch_size, args.global_batch_size
    for rank in layout.ranks:
        replicas = replica_count(layout, rank)
        if gbs % (mbs * replicas):
            return (f"--global-batch-size {gbs} is not a multiple of --micro-batch-size "
                    f"{mbs} x {replicas} (the replicas of rank {rank}'s stage): Megatron-LM "
                    f"counts consumed samples per replica; choose micro-batch counts that "
                    f"make it one")
    return None


def replica_count(layout: Layout, rank: int) -> int:
    """The size of ``rank``'s data-parallel group (its exact replicas)."""
    return len(replica_ranks(layout, rank))


# ----------------------------------------------------------------------- replacements


def wrap_setup_model(original: Callable, installation: Installation) -> Callable:
    """At core_r0.19.0 ``pretrain_gpt.py`` builds the model config (``cfg_container.model``)
    from the arguments before ``pretrain`` installs the parallel state, i.e. before
    ``adapt_args`` gives this rank its stage: built from it, every stage would hold the
    whole decoder at the placeholder TP and PP. Under a layout the model config is built
    again from the adapted arguments (core_v0.16.1 passes no container: its model
    provider reads the arguments when it builds the model)."""
    def setup_model_and_optimizer(*args, **kwargs):
        container = kwargs.get("cfg_container")
        if container is not None and getattr(container, "model", None) is not None \
                and installation.layout is not None:
            container.model = _model_config_from_args(container.model)
        return original(*args, **kwargs)
    return setup_model_and_optimizer


def wrap_validate(original: Callable) -> Callable:
    """Megatron-LM validates a heterogeneous layout's placeholder sizes (TP 1, PP 1)
    before the parallel state exists, and derives from them a data-parallel size of the
    whole world, which its batch checks and micro-batch calculator require the global
    batch to divide (16 on 5 ranks does not). It validates them as one rank instead
    (data-parallel size 1); ``adapt_args`` sets every rank's own sizes and micro-batch
    count once its stage is known. Megatron-LM turns ``--sequence-parallel`` off at the
    placeholder TP 1 (core_v0.19.0's ``pretrain_gpt.py`` builds a model config from the
    placeholders, which refuses it); ``adapt_args`` turns it back on for stages of
    TP > 1 from ``args.elastor_sequence_parallel``, which the parser recorded."""
    def validate_args(args, *rest, **kwargs):
        if not is_heterogeneous(args):
            return original(args, *rest, **kwargs)
        log.info("heterogeneous --elastor-layout: Megatron-LM validates its placeholder "
                 "sizes as one rank; each rank's TP, PP and data-parallel size follow "
                 "from its stage")
        world_size, args.world_size = args.world_size, 1
        try:
            return original(args, *rest, **kwargs)
        finally:
            args.world_size = world_size
    return validate_args


def wrap_get_optimizer(original: Callable, installation: Installation) -> Callable:
    """The model's replicas in other pipelines made equal (``broadcast_replicas``) just
    before the optimizer copies the weights (both releases build the model, through
    ``get_model`` or a model builder, then call this with it): a fresh start would
    otherwise train pipelines that disagree on every layer they share. A checkpoint
    loaded afterwards overwrites all. Under ``--use-distributed-optimizer`` Megatron
    builds its plain fp32 optimizer over the model's own weights (for its param groups;
    no fp32 copy), which ``zero_megatron_optimizer`` turns into ZeRO-1 across pipelines,
    each rank allocating the fp32 state of its shard only. Under
    ``--elastor-report-memory`` the tensors the build allocates are measured."""
    def get_megatron_optimizer(config, model_chunks, *args, **kwargs):
        if installation.heterogeneous():
            from megatron.core.utils import unwrap_model

            received = broadcast_replicas(installation.groups.layout,
                                          unwrap_model(_single_chunk(model_chunks)),
                                          installation.cache)
            log.info("rank %d: %d parameter elements set from their replicas in other "
                     "pipelines", dist.get_rank(), received)
        if installation.layout is None or not installation.options().report_memory:
            return _build_optimizer(original, installation, config, model_chunks,
                                    *args, **kwargs)
        chunks = model_chunks if isinstance(model_chunks, list) else [model_chunks]
        before = memory.held_bytes(torch.nn.ModuleList(chunks))
        meter = memory.AllocationMeter()
        with meter:
            optimizer = _build_optimizer(original, installation, config, model_chunks,
                                         *args, **kwargs)
        installation.startup_memory = memory.StartupMemory.measured(before, meter)
        return optimizer
    return get_megatron_optimizer


def _build_optimizer(original: Callable, installation: Installation, config, model_chunks,
                     *args, **kwargs):
    """Megatron's optimizer, or on a heterogeneous layout under
    ``--use-distributed-optimizer`` ZeRO-1 across pipelines behind its interface; and
    which ranks' checkpointed tensors are the same (``Installation.state_replicas``)."""
    optimizer = _megatron_or_zero_optimizer(original, installation, config, model_chunks,
                                            *args, **kwargs)
    installation.state_replicas = zarr_format.state_replicas(
        installation.layout, installation.zero, config.use_distributed_optimizer)
    return optimizer


def _megatron_or_zero_optimizer(original: Callable, installation: Installation, config,
                                model_chunks, *args, **kwargs):
    if not installation.heterogeneous() or not config.use_distributed_optimizer:
        return original(config, model_chunks, *args, **kwargs)
    from megatron.core.utils import unwrap_model

    from elastor_mcore.integrations.megatron_lm.zero_optimizer import (
        uncopied_config, zero_megatron_optimizer)  # a subclass of Megatron's optimizer

    from megatron.training import get_args

    # Unwrapped as Megatron-LM's checkpoints are: the ZeRO-1 state's keys are its.
    model = unwrap_model(_single_chunk(model_chunks))
    plain = original(uncopied_config(config), model_chunks, *args, **kwargs)
    plan = ShardPlan.build(installation.groups.layout, model, installation.cache,
                           installation.options().save.chunking)
    megatron_args = get_args()
    zero = installation.zero = ZeroShards(
        plan, installation.cache, next(model.parameters()).device,
        backward_order(key_position) if megatron_args.overlap_grad_reduce else None)
    gather_weights = zero.copy_main_to_model
    if megatron_args.overlap_param_gather:
        gather = ParamGather(zero, model)
        serve_param_sync(_single_chunk(model_chunks), gather)
        gather_weights = gather.start
    return zero_megatron_optimizer(
        plain, dataclasses.replace(config, use_distributed_optimizer=False), zero,
        lambda: installation.schedule.norm, gather_weights)


def _model_config_from_args(built):
    """``built``'s class of model config from this rank's adapted arguments."""
    from megatron.training import get_args
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.models import GPTModelConfig

    if not isinstance(built, GPTModelConfig):
        raise RuntimeError(f"--elastor-layout builds GPT models only; Megatron-LM's model "
                           f"config is a {type(built).__name__}")
    return gpt_config_from_args(get_args(), model_config_cls=type(built))


def wrap_train(original: Callable, installation: Installation) -> Callable:
    def train(forward_step_func, model, optimizer, *args, **kwargs):
        if installation.heterogeneous():
            _check_optimizer(optimizer)
        if installation.layout is not None and installation.options().report_memory:
            installation.memory_report = MemoryReport(installation.options().hardware,
                                                      optimizer, installation.startup_memory)
        return original(forward_step_func, model, optimizer, *args, **kwargs)
    return train


def _check_optimizer(optimizer) -> None:
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(chained) != 1:
        raise RuntimeError(
            f"Megatron built {len(chained)} optimizers; on a heterogeneous layout the "
            f"global gradient norm is given to one optimizer only (a dense model without "
            f"separate optimizer groups)")


def wrap_schedule_getter(original: Callable, installation: Installation) -> Callable:
    def get_forward_backward_func(*args, **kwargs):
        schedule = (functools.partial(forward_backward, installation)
                    if installation.heterogeneous() else original(*args, **kwargs))
        report = installation.memory_report
        if report is None:
            return schedule
        from megatron.training import get_args

        return report.wrap(schedule, installation.groups, lambda: recipe_from_args(get_args()))
    return get_forward_backward_func


def wrap_grad_norm(original: Callable, installation: Installation) -> Callable:
    def get_grad_norm_fp32(*args, **kwargs):
        stage = installation.schedule if installation.heterogeneous() else None
        if stage is not None and stage.norm is not None:
            return stage.norm
        return original(*args, **kwargs)
    return get_grad_norm_fp32


def wrap_data_loader(original: Callable, installation: Installation) -> Callable:
    def build_pretraining_data_loader(dataset, consumed_samples):
        if dataset is None or not installation.heterogeneous():
            return original(dataset, consumed_samples)
        from megatron.training import get_args

        args = get_args()
        groups = installation.groups
        sampler = PipelineBatchSampler(
            groups.layout, groups.position.pipeline, args.global_batch_size,
            args.micro_batch_size, len(dataset), consumed_samples)
        return torch.utils.data.DataLoader(
            dataset, batch_sampler=sampler, num_workers=args.num_workers,
            pin_memory=torch.cuda.is_available(), persistent_workers=args.num_workers > 0)
    return build_pretraining_data_loader


# ------------------------------------------------------------------------------- data


@dataclass(frozen=True)
class PipelineBatchSampler:
    """Micro-batches (lists of sample indices) of one pipeline's slice of every global
    batch, from the batch after ``consumed_samples`` to the last whole batch."""

    layout: Layout
    pipeline: int
    global_batch_size: int
    micro_batch_size: int
    total_samples: int
    consumed_samples: int

    def __post_init__(self) -> None:
        if self.consumed_samples % self.global_batch_size:
            raise ValueError(
                f"consumed samples {self.consumed_samples} are not a whole number of "
                f"global batches of {self.global_batch_size}; a heterogeneous layout "
                f"resumes at a global-batch boundary")

    def _steps(self) -> range:
        return range(self.consumed_samples // self.global_batch_size,
                     self.total_samples // self.global_batch_size)

    def __len__(self) -> int:
        return len(self._steps()) * self.layout.pipelines[self.pipeline].micro_batches

    def __iter__(self) -> Iterator[list[int]]:
        steps = self._steps()
        indices = pipeline_sample_indices(self.layout, self.pipeline, self.global_batch_size,
                                          self.micro_batch_size, steps.start, steps.stop)
        batch: list[int] = []
        for index in indices:
            batch.append(index)
            if len(batch) == self.micro_batch_size:
                yield batch
                batch = []


# --------------------------------------------------------------------------- schedule


def forward_backward(installation: Installation, *, forward_step_func, data_iterator, model,
                     forward_only: bool = False, collect_non_loss_data: bool = False,
                     **_megatron_shape_args) -> list[dict]:
    """Megatron's ``forward_backward_func`` interface on a heterogeneous layout (the
    replaced ``get_forward_backward_func`` binds ``installation``): the layout's
    micro-batch count (Megatron's ``num_microbatches`` and tensor shapes are ignored),
    Elastor's 1F1B and P2P, then the cross-pipeline gradient reduction. Returns on a
    last stage one report summed over the global batch, else []."""
    if collect_non_loss_data:
        raise ValueError("non-loss data collection (--log-... callbacks of "
                         "process_non_loss_data_func) is not supported on a "
                         "heterogeneous layout")
    chunk = _single_chunk(model)
    iterator = data_iterator[0] if isinstance(data_iterator, list) else data_iterator
    stage = _schedule_state(installation, chunk)
    stage.norm = None
    groups = stage.groups
    from megatron.core.utils import get_attr_wrapped_model, get_model_config

    config = get_model_config(chunk)
    set_input_tensor = get_attr_wrapped_model(chunk, "set_input_tensor")
    tokens = torch.zeros((), dtype=torch.float64, device=stage.comm.device)
    reports: list[dict] = []

    def forward(_: int, x: torch.Tensor | None) -> torch.Tensor:
        nonlocal tokens
        set_input_tensor(x)
        output, loss_func = forward_step_func(iterator, chunk)
        if not groups.is_last_stage:
            return output
        loss, num_tokens, report = _loss_parts(loss_func(output))
        tokens += num_tokens.detach().double()
        reports.append(report)
        if not forward_only and config.grad_scale_func is not None:
            loss = config.grad_scale_func(loss)
        return loss

    count = groups.layout.pipelines[groups.position.pipeline].micro_batches
    if forward_only:
        for i in range(count):
            stage.comm.send_forward(forward(i, stage.comm.recv_forward()))
    else:
        if stage.overlap is not None:
            stage.overlap.begin(count)
        # DDP's own gradient sync stays off (it would reduce over exact replicas only).
        with getattr(chunk, "no_sync", contextlib.nullcontext)():
            run_1f1b(count, groups.position.stage, groups.num_stages, stage.comm, forward)
        _finalize_grads(stage, tokens)
    return _global_report(stage, reports)


def _single_chunk(model):
    if isinstance(model, list):
        if len(model) != 1:
            raise ValueError("virtual pipeline stages are not supported on a "
                             "heterogeneous layout")
        return model[0]
    return model


def _loss_parts(outputs) -> tuple[torch.Tensor, torch.Tensor, dict]:
    if not isinstance(outputs, tuple) or len(outputs) != 3:
        raise ValueError(
            "on a heterogeneous layout the loss function must return (loss summed over "
            "tokens, token count, report), as pretrain_gpt.py's does; a per-micro-batch "
            "mean cannot be weighted over pipelines of different micro-batch counts")
    loss, num_tokens, report = outputs
    for key, value in report.items():
        if value.numel() != 2:
            raise ValueError(f"loss report {key!r} must be a [sum, count] pair to be "
                             f"summed over the global batch, got shape {tuple(value.shape)}")
    return loss, torch.as_tensor(num_tokens), report


def _schedule_state(installation: Installation, chunk) -> ScheduleState:
    """This rank's schedule state, built on the first call (collective over the world:
    every rank calls the schedule at the same step)."""
    if installation.schedule is not None:
        return installation.schedule
    from megatron.core.utils import get_attr_wrapped_model, get_model_config

    from megatron.training import get_args

    args = get_args()
    groups = installation.groups
    layout = groups.layout
    cache = installation.cache
    model = get_attr_wrapped_model(chunk, "sharded_state_dict", return_model_obj=True)
    # Megatron's bucket size (--ddp-bucket-size or its default; None without overlap).
    bucket_size = getattr(getattr(chunk, "ddp_config", None), "bucket_size", None)
    grad_sync = installation.zero or GradientSynchronizer(
        layout, model, cache,
        order=backward_order(key_position, bucket_size) if args.overlap_grad_reduce else None)
    last_stage_ranks = [r for pipe in layout.pipelines for r in pipe.stages[-1].ranks]
    last_stages = cache.get(last_stage_ranks)
    config = get_model_config(chunk)
    shape = (args.seq_length, args.micro_batch_size, args.hidden_size)
    dtype = config.pipeline_dtype or config.params_dtype
    device = next(chunk.parameters()).device
    sequence_parallel = installation.options().sequence_parallel
    comm = StageCommunicator(stage_links(layout, groups.rank, sequence_parallel), shape,
                             dtype, device)
    overlap = None
    if args.overlap_grad_reduce:
        overlap = GradReadiness(grad_sync, [
            sequence_parallel and tp_replicated(layout, holders)
            for holders in grad_sync.bucket_holders()])
    installation.schedule = ScheduleState(groups, grad_sync, comm, last_stages,
                                          SequenceParallelGrads(model, groups.tp), overlap)
    log.info("rank %d: Megatron-LM's loop on heterogeneous layout %s%s%s", groups.rank,
             layout.describe(), ", sequence parallel" if sequence_parallel else "",
             ", reduction overlapping backward" if overlap else "")
    return installation.schedule


def _contributes(groups: RankGroups) -> bool:
    """The one rank per pipeline whose loss sums count (TP ranks repeat them)."""
    return groups.is_last_stage and groups.position.tp_rank == 0


@torch.no_grad()
def _finalize_grads(stage: ScheduleState, tokens: torch.Tensor) -> None:
    """Sum the sequence-parallel norms' ``main_grad`` over TP, all of it over pipelines
    (or wait for the sums started during the backward), divide by the global batch's
    tokens, and compute the global norm every rank's optimizer clips by."""
    groups = stage.groups
    if stage.overlap is not None:
        stage.overlap.finish(before_deferred=stage.sequence_parallel_grads.reduce)
    else:
        stage.sequence_parallel_grads.reduce()
        stage.grad_sync.reduce()
    total = tokens if _contributes(groups) else torch.zeros_like(tokens)
    dist.all_reduce(total, group=groups.active)
    if total.item() <= 0:
        raise RuntimeError("the global batch has no loss tokens (every loss_mask is zero)")
    stage.grad_sync.scale_(1.0 / total.item())
    norm = stage.grad_sync.global_norm(groups.active)
    if not math.isfinite(norm):
        from megatron.training import get_args

        if get_args().check_for_nan_in_loss_and_grad:
            raise RuntimeError(f"the global gradient norm is {norm} (NaN or Inf in the "
                               f"gradients of some pipeline); every rank stops here")
    stage.norm = norm


def _global_report(stage: ScheduleState, reports: list[dict]) -> list[dict]:
    """On last stages, the micro-batches' reports summed over every pipeline (every
    pipeline runs at least one micro-batch, and the same loss function)."""
    if not stage.groups.is_last_stage:
        return []
    keys = sorted(reports[0])
    sums = torch.stack([torch.stack([r[k].view(-1).double() for r in reports]).sum(0)
                        for k in keys])
    if not _contributes(stage.groups):
        sums.zero_()
    dist.all_reduce(sums, group=stage.last_stages)
    like = reports[0][keys[0]]
    return [{k: sums[i].to(like.dtype) for i, k in enumerate(keys)}]
