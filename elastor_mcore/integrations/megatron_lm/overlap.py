"""``--overlap-grad-reduce`` and ``--overlap-param-gather`` on heterogeneous layouts:
Elastor's cross-pipeline gradient reduction and ZeRO-1's all-gather of the weights,
started bucket by bucket while the model computes, as Megatron's DDP starts its own
data-parallel ones on uniform layouts.

* ``GradReadiness``: during the last micro-batch's backward, a bucket of the reduction
  (``runtime/grad_sync.py``'s ``GradientSynchronizer``, or ``ZeroShards``' reduce-scatter)
  starts as soon as every parameter it reads has its final gradient (its gradient
  accumulator has run once per micro-batch), in the one order every rank issues
  buckets in (``grad_sync.backward_order``: layer by layer, last layer first, cut at
  Megatron's ``--ddp-bucket-size``). Under sequence parallelism, the buckets of
  TP-replicated weights (the norms, whose gradients are partial sums until they are
  summed over the TP group) wait for that sum, after the backward.
* ``ParamGather``: after the optimizer step, ZeRO-1's all-gathers start (first layers
  first) instead of running to completion, and a forward pre-hook on every module waits
  for the buckets holding its weights: the next step's first layers compute while later
  layers' weights are still gathered. Megatron-LM's loop drives it through the model
  chunk's ``start_param_sync`` / ``enable_forward_pre_hook`` / ``disable_forward_pre_hook``,
  as it drives its DDP's (``serve_param_sync``).
"""

from __future__ import annotations

import logging
import math
import re
from typing import Callable, Protocol, Sequence

import torch
import torch.distributed as dist

from elastor_mcore.parallel.layout import Layout
from elastor_mcore.runtime.distributed_optimizer import ZeroShards
from elastor_mcore.runtime.grad_sync import Pending

log = logging.getLogger(__name__)

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def key_position(key: str) -> float:
    """Where a weight's checkpoint key sits in the forward pass: the embedding before
    layer 0, a decoder layer at its global number, the final norm and the output layer
    after every layer (``grad_sync.backward_order``'s ``position``)."""
    match = _LAYER.search(key)
    if match:
        return float(match.group(1))
    return -1.0 if "embedding" in key else math.inf


class Reduction(Protocol):
    """What ``GradientSynchronizer`` and ``ZeroShards`` offer for bucket-wise reduction."""

    def bucket_holders(self) -> list[tuple[int, ...]]: ...
    def bucket_parameters(self) -> list[list[torch.nn.Parameter]]: ...
    def start(self, index: int) -> Pending: ...
    def finish(self, pending: Pending) -> None: ...


def tp_replicated(layout: Layout, holders: Sequence[int]) -> bool:
    """Whether two of ``holders`` are TP ranks of one stage (the bucket holds weights
    every TP rank of a stage holds whole: norms)."""
    stages = [(p.pipeline, p.stage) for p in map(layout.position, holders)]
    return len(set(stages)) < len(stages)


class GradReadiness:
    """Starts ``reduction``'s buckets as their gradients become final during the last
    micro-batch's backward (see the module). ``deferred[i]``: bucket ``i`` starts only
    in ``finish``, after ``before_deferred`` (the TP sum of sequence-parallel norms)."""

    def __init__(self, reduction: Reduction, deferred: Sequence[bool]) -> None:
        self.reduction = reduction
        buckets = reduction.bucket_parameters()
        self._order = ([i for i, d in enumerate(deferred) if not d]
                       + [i for i, d in enumerate(deferred) if d])
        self._early = len(self._order) - sum(map(bool, deferred))
        self._size = [len(params) for params in buckets]
        self._buckets_of: dict[int, list[int]] = {}
        params: dict[int, torch.nn.Parameter] = {}
        for index, bucket in enumerate(buckets):
            for param in bucket:
                params[id(param)] = param
                self._buckets_of.setdefault(id(param), []).append(index)
        self._accumulators = []  # referenced, as DDP's grad_accs: the hooks live on them
        for param in params.values():
            # After DDP's own hook on the same accumulator (registered when DDP was
            # built): the gradient is in main_grad when this one runs.
            accumulator = param.expand_as(param).grad_fn.next_functions[0][0]
            accumulator.register_hook(self._hook(id(param)))
            self._accumulators.append(accumulator)
        self.begin(0)
        self._active = False
        self.started_in_backward: int | None = None
        """Buckets the last step started before its backward ended (a diagnostic)."""

    def begin(self, micro_batches: int) -> None:
        """A training step of ``micro_batches`` micro-batches starts."""
        self._micro_batches = micro_batches
        self._backwards = {key: 0 for key in self._buckets_of}
        self._waiting = list(self._size)
        self._next = 0
        self._pending: list[Pending] = []
        self._active = True

    def _hook(self, key: int) -> Callable:
        def grad_accumulated(*_unused) -> None:
            if not self._active:
                return
            self._backwards[key] += 1
            if self._backwards[key] == self._micro_batches:
                for index in self._buckets_of[key]:
                    self._waiting[index] -= 1
                self._start_ready()
        return grad_accumulated

    def _start_ready(self) -> None:
        while self._next < self._early and self._waiting[self._order[self._next]] == 0:
            self._start_next()

    def _start_next(self) -> None:
        self._pending.append(self.reduction.start(self._order[self._next]))
        self._next += 1

    def finish(self, before_deferred: Callable[[], None]) -> None:
        """After the last backward: start what has not started (buckets whose weights
        got no gradient too), run ``before_deferred``, start the deferred buckets, and
        wait for all of them."""
        self._active = False
        if self.started_in_backward is None:  # the first step: say how much overlapped
            log.info("rank %d: %d of %d gradient buckets started during the backward "
                     "(--overlap-grad-reduce)", dist.get_rank(), self._next, len(self._order))
        self.started_in_backward = self._next
        while self._next < self._early:
            self._start_next()
        before_deferred()
        while self._next < len(self._order):
            self._start_next()
        for pending in self._pending:
            self.reduction.finish(pending)
        self._pending = []


class ParamGather:
    """ZeRO-1's all-gathers of the weights overlapped with the next forward (see the
    module)."""

    def __init__(self, shards: ZeroShards, module: torch.nn.Module) -> None:
        self.shards = shards
        self.module = module
        self._buckets_of: dict[int, list[int]] = {}
        for index, params in enumerate(shards.bucket_parameters()):
            for param in params:
                self._buckets_of.setdefault(id(param), []).append(index)
        self._count = len(shards.bucket_parameters())
        self._pending: dict[int, Pending] = {}
        self._handles: list = []
        self.waited_in_forward = 0
        """All-gathers a forward pre-hook completed (a diagnostic)."""
        self._announced = False

    def start(self) -> None:
        """Start every bucket's all-gather, in the order a forward pass needs them
        (the reverse of the reduction's, on every rank)."""
        self.wait_all()
        for index in reversed(range(self._count)):
            self._pending[index] = self.shards.start_gather(index)

    def wait(self, indices) -> None:
        for index in sorted(indices, reverse=True):
            pending = self._pending.pop(index, None)
            if pending is not None:
                self.shards.finish_gather(pending)

    def wait_all(self) -> None:
        self.wait(list(self._pending))

    def _pre_hook(self, module: torch.nn.Module, *_unused) -> None:
        if not self._pending:
            return
        if not self._announced:
            self._announced = True
            log.info("rank %d: the forward waits module by module for %d ZeRO-1 "
                     "all-gathers in flight (--overlap-param-gather)", dist.get_rank(),
                     len(self._pending))
        needed = {index for param in module.parameters(recurse=False)
                  for index in self._buckets_of.get(id(param), ())}
        self.waited_in_forward += len(needed & self._pending.keys())
        self.wait(needed)

    # Megatron-LM's loop calls these on the model chunk (DDP's names and signatures).

    def enable_forward_pre_hook(self) -> None:
        self.disable_forward_pre_hook(param_sync=False)
        self._handles = [m.register_forward_pre_hook(self._pre_hook)
                         for m in self.module.modules()]

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if param_sync:
            self.wait_all()

    def start_param_sync(self, *_unused, force_sync: bool = False,
                         force_dispatch: bool = False) -> None:
        """DDP's entry point: the all-gathers were started by the optimizer step;
        ``force_sync`` (before a save, evaluation or the end) waits for all of them."""
        if force_sync:
            self.wait_all()


def serve_param_sync(ddp: torch.nn.Module, gather: ParamGather) -> None:
    """Let Megatron-LM's loop drive ``gather`` where it drives its DDP's all-gather of
    the weights: DDP's own forward pre-hooks are removed (its all-gather spans exact
    replicas only), and the chunk's ``start_param_sync`` and forward pre-hook switches
    become ``gather``'s."""
    if getattr(ddp, "use_forward_hook", False) and ddp.remove_forward_pre_hook_handles:
        ddp.disable_forward_pre_hook(param_sync=False)
    ddp.start_param_sync = gather.start_param_sync
    ddp.enable_forward_pre_hook = gather.enable_forward_pre_hook
    ddp.disable_forward_pre_hook = gather.disable_forward_pre_hook
    gather.enable_forward_pre_hook()
    log.info("--overlap-param-gather: ZeRO-1's all-gathers overlap the next forward "
             "(%d buckets)", gather._count)
