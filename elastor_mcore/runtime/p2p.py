"""Activation and gradient exchange between adjacent stages whose TP may differ.

Each rank of a stage holds some rows of the ``[s, b, h]`` activation (and of the
gradient of its input): all of them without sequence parallelism (the activations are
replicated across the TP group), rows ``[i s/tp, (i+1) s/tp)`` on TP rank ``i`` with
it. A boundary from stage ``A`` to stage ``B`` is then the common refinement of the two
stages' row splits (``geometry.py``'s idea on the sequence axis): each row range a
receiver needs is cut at the holders' boundaries, and each piece comes from one holder
of it, so every rank receives exactly the rows it needs, once.

Where several ranks hold a piece (replicated activations) the receiver with TP rank
``j`` takes it from the ``j % holders``-th: without sequence parallelism ``B[j]``
receives from ``A[j % a]`` forward and ``A[i]`` from ``B[i % b]`` backward, the
senders sharing the fan-out evenly. With it, TP 4 -> 2 sends each receiver two
quarters, TP 2 -> 4 each receiver half of one sender's rows, TP 2 -> 1 the receiver
both halves, and the gradient flows back the same way.

Rows are kept as fractions of the sequence, so the links are a property of the layout
alone; the communicator turns them into rows of its activation shape. Buffers live on
the tensors' own device; nothing here assumes CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.distributed as dist

from elastor_mcore.parallel.layout import Layout, Stage

Rows = tuple[Fraction, Fraction]
"""``[start, stop)`` as fractions of the sequence."""

WHOLE: Rows = (Fraction(0), Fraction(1))


def stage_rows(stage: Stage, tp_rank: int, sequence_parallel: bool) -> Rows:
    """The rows TP rank ``tp_rank`` of ``stage`` holds."""
    if not sequence_parallel or stage.tp == 1:
        return WHOLE
    return Fraction(tp_rank, stage.tp), Fraction(tp_rank + 1, stage.tp)


@dataclass(frozen=True)
class Transfer:
    """One message: ``rows`` of the activation (or gradient), to or from ``peer``."""

    peer: int
    rows: Rows


@dataclass(frozen=True)
class StageLinks:
    """Who this rank exchanges which rows with, forward and backward."""

    rows: Rows
    """The rows this rank holds."""
    recv_forward: tuple[Transfer, ...]
    send_forward: tuple[Transfer, ...]
    recv_backward: tuple[Transfer, ...]
    send_backward: tuple[Transfer, ...]


def pieces(holders: Stage, needed: Rows, tp_rank: int, sequence_parallel: bool
           ) -> tuple[Transfer, ...]:
    """``needed`` cut at the row boundaries of ``holders``, each piece from one of its
    holders (the ``tp_rank % count``-th, ``tp_rank`` being the receiver's)."""
    held = [stage_rows(holders, k, sequence_parallel) for k in range(holders.tp)]
    lo, hi = needed
    cuts = sorted({lo, hi} | {b for rows in held for b in rows if lo < b < hi})
    out = []
    for start, stop in zip(cuts, cuts[1:]):
        have = [holders.ranks[k] for k, (a, b) in enumerate(held) if a <= start and stop <= b]
        out.append(Transfer(have[tp_rank % len(have)], (start, stop)))
    return tuple(out)


def _sends(here: Stage, rank: int, to: Stage, sequence_parallel: bool
           ) -> tuple[Transfer, ...]:
    """What ``rank`` of ``here`` sends to the ranks of the neighbour stage ``to``: the
    pieces whose chosen holder is ``rank``."""
    return tuple(Transfer(dst, t.rows) for j, dst in enumerate(to.ranks)
                 for t in pieces(here, stage_rows(to, j, sequence_parallel), j,
                                 sequence_parallel) if t.peer == rank)


def stage_links(layout: Layout, rank: int, sequence_parallel: bool = False) -> StageLinks:
    pos = layout.position(rank)
    stages = layout.pipelines[pos.pipeline].stages
    here = stages[pos.stage]
    prev = stages[pos.stage - 1] if pos.stage > 0 else None
    nxt = stages[pos.stage + 1] if pos.stage + 1 < len(stages) else None
    i, sp = pos.tp_rank, sequence_parallel
    rows = stage_rows(here, i, sp)
    return StageLinks(
        rows=rows,
        recv_forward=pieces(prev, rows, i, sp) if prev else (),
        send_forward=_sends(here, rank, nxt, sp) if nxt else (),
        recv_backward=pieces(nxt, rows, i, sp) if nxt else (),
        send_backward=_sends(here, rank, prev, sp) if prev else (),
    )


class StageCommunicator:
    """Posts a step's sends and receives together, then waits for all of them, so
    that 1F1B's paired send/receive calls cannot deadlock.

    ``shape`` is the full ``[s, b, h]`` activation; this rank's tensors hold
    ``local_shape``, its ``links.rows`` of it.
    """

    def __init__(self, links: StageLinks, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.links = links
        self.shape, self.dtype, self.device = shape, dtype, device
        self._start = self._row(links.rows[0])
        self.local_shape = (self._row(links.rows[1]) - self._start, *shape[1:])
        self.bytes_sent = 0
        self.bytes_received = 0

    def _row(self, fraction: Fraction) -> int:
        row = fraction * self.shape[0]
        if row.denominator != 1:
            raise ValueError(f"sequence length {self.shape[0]} does not split at {fraction} "
                             f"of the sequence; with sequence parallelism every stage's TP "
                             f"must divide it")
        return int(row)

    def _local(self, tensor: torch.Tensor, rows: Rows) -> torch.Tensor:
        """The part of a local tensor that is the global ``rows``: a view."""
        start = self._row(rows[0]) - self._start
        return tensor.narrow(0, start, self._row(rows[1]) - self._row(rows[0]))

    def _exchange(self, sends: list[tuple[torch.Tensor, int]],
                  receives: tuple[Transfer, ...]) -> torch.Tensor | None:
        ops = []
        received = None
        if receives:
            received = torch.empty(self.local_shape, dtype=self.dtype, device=self.device)
            ops.extend(dist.P2POp(dist.irecv, self._local(received, t.rows), t.peer)
                       for t in receives)
            self.bytes_received += received.numel() * received.element_size()
        ops.extend(dist.P2POp(dist.isend, t, dst) for t, dst in sends)
        self.bytes_sent += sum(t.numel() * t.element_size() for t, _ in sends)
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return received

    def _sends(self, tensor: torch.Tensor | None, transfers: tuple[Transfer, ...]):
        if tensor is None:
            return []
        tensor = tensor.detach().contiguous()
        return [(self._local(tensor, t.rows), t.peer) for t in transfers]

    def recv_forward(self) -> torch.Tensor | None:
        return self._exchange([], self.links.recv_forward)

    def send_forward(self, output: torch.Tensor | None) -> None:
        self._exchange(self._sends(output, self.links.send_forward), ())

    def recv_backward(self) -> torch.Tensor | None:
        return self._exchange([], self.links.recv_backward)

    def send_backward(self, grad: torch.Tensor | None) -> None:
        self._exchange(self._sends(grad, self.links.send_backward), ())

    def send_forward_recv_backward(self, output: torch.Tensor | None) -> torch.Tensor | None:
        return self._exchange(self._sends(output, self.links.send_forward),
                              self.links.recv_backward)

    def send_backward_recv_forward(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        return self._exchange(self._sends(grad, self.links.send_backward),
                              self.links.recv_forward)
