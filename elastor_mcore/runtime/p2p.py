"""Activation and gradient exchange between adjacent stages whose TP may differ.

Without sequence parallelism a stage's output activations are replicated across its
TP group, and so is the gradient of its input. A boundary from stage ``s`` (ranks
``A``, TP ``a``) to stage ``s+1`` (ranks ``B``, TP ``b``) therefore needs each
receiving rank to get one full copy, from one sender:

* forward: ``B[j]`` receives from ``A[j % a]`` (senders share the fan-out evenly);
* backward: ``A[i]`` receives from ``B[i % b]``.

Every rank receives exactly what it needs, once: ``b`` activations and ``a`` gradients
cross the boundary per micro-batch, the minimum for full replicas. Buffers live on the
tensors' own device; nothing here assumes CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from elastor_mcore.parallel.layout import Layout


@dataclass(frozen=True)
class StageLinks:
    """Who this rank exchanges with, forward and backward."""

    recv_forward_from: int | None
    send_forward_to: tuple[int, ...]
    recv_backward_from: int | None
    send_backward_to: tuple[int, ...]


def stage_links(layout: Layout, rank: int) -> StageLinks:
    pos = layout.position(rank)
    stages = layout.pipelines[pos.pipeline].stages
    here = stages[pos.stage]
    prev = stages[pos.stage - 1] if pos.stage > 0 else None
    nxt = stages[pos.stage + 1] if pos.stage + 1 < len(stages) else None
    i = pos.tp_rank
    return StageLinks(
        recv_forward_from=prev.ranks[i % prev.tp] if prev else None,
        send_forward_to=tuple(r for j, r in enumerate(nxt.ranks) if j % here.tp == i)
        if nxt else (),
        recv_backward_from=nxt.ranks[i % nxt.tp] if nxt else None,
        send_backward_to=tuple(r for j, r in enumerate(prev.ranks) if j % here.tp == i)
        if prev else (),
    )


class StageCommunicator:
    """Posts a step's sends and receives together, then waits for all of them, so
    that 1F1B's paired send/receive calls cannot deadlock."""

    def __init__(self, links: StageLinks, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.links = links
        self.shape, self.dtype, self.device = shape, dtype, device
        self.bytes_sent = 0
        self.bytes_received = 0

    def _exchange(self, sends: list[tuple[torch.Tensor, int]], recv_from: int | None):
        ops = []
        received = None
        if recv_from is not None:
            received = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, received, recv_from))
        ops.extend(dist.P2POp(dist.isend, t, dst) for t, dst in sends)
        self.bytes_sent += sum(t.numel() * t.element_size() for t, _ in sends)
        if received is not None:
            self.bytes_received += received.numel() * received.element_size()
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return received

    def _sends(self, tensor: torch.Tensor | None, targets: tuple[int, ...]):
        if tensor is None:
            return []
        tensor = tensor.detach().contiguous()
        return [(tensor, dst) for dst in targets]

    def recv_forward(self) -> torch.Tensor | None:
        return self._exchange([], self.links.recv_forward_from)

    def send_forward(self, output: torch.Tensor | None) -> None:
        self._exchange(self._sends(output, self.links.send_forward_to), None)

    def recv_backward(self) -> torch.Tensor | None:
        return self._exchange([], self.links.recv_backward_from)

    def send_backward(self, grad: torch.Tensor | None) -> None:
        self._exchange(self._sends(grad, self.links.send_backward_to), None)

    def send_forward_recv_backward(self, output: torch.Tensor | None) -> torch.Tensor | None:
        return self._exchange(self._sends(output, self.links.send_forward_to),
                              self.links.recv_backward_from)

    def send_backward_recv_forward(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        return self._exchange(self._sends(grad, self.links.send_backward_to),
                              self.links.recv_forward_from)
