"""A device-agnostic, non-interleaved 1F1B pipeline schedule for one stage.

Stage ``s`` of ``S`` runs ``min(S - s - 1, M)`` warm-up forwards, then alternates one
forward and one backward, then drains the remaining backwards; at most ``S - s``
micro-batches' activations are alive at once. Every stage of a pipeline runs the same
micro-batch count, so the paired exchanges of adjacent stages always match.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import torch

from elastor_mcore.runtime.p2p import StageCommunicator

ForwardFn = Callable[[int, "torch.Tensor | None"], torch.Tensor]
"""``forward(micro_batch_index, input_activation_or_None) -> output``; on the last
stage the output is the micro-batch's scalar loss contribution."""


def run_1f1b(num_micro_batches: int, stage: int, num_stages: int,
             comm: StageCommunicator, forward: ForwardFn) -> None:
    """Run forward and backward for every micro-batch; gradients accumulate in
    ``.grad``."""
    inputs: deque = deque()
    outputs: deque = deque()
    next_micro_batch = 0

    def forward_one(x: torch.Tensor | None) -> torch.Tensor:
        nonlocal next_micro_batch
        if x is not None:
            x.requires_grad_(True)
        y = forward(next_micro_batch, x)
        next_micro_batch += 1
        inputs.append(x)
        outputs.append(y)
        return y

    def backward_one(output_grad: torch.Tensor | None) -> torch.Tensor | None:
        x, y = inputs.popleft(), outputs.popleft()
        torch.autograd.backward(y, grad_tensors=output_grad)
        return x.grad if x is not None else None

    warmup = min(num_stages - stage - 1, num_micro_batches)
    steady = num_micro_batches - warmup
    for _ in range(warmup):
        comm.send_forward(forward_one(comm.recv_forward()))
    x = comm.recv_forward() if steady else None
    for i in range(steady):
        output_grad = comm.send_forward_recv_backward(forward_one(x))
        input_grad = backward_one(output_grad)
        if i == steady - 1:
            comm.send_backward(input_grad)
        else:
            x = comm.send_backward_recv_forward(input_grad)
    for _ in range(warmup):
        comm.send_backward(backward_one(comm.recv_backward()))
