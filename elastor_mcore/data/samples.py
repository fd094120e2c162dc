"""Layout-independent training data: sample ``i`` of the run never depends on the layout.

A ``SampleSource`` maps a global sample index to ``seq_length + 1`` token ids
(inputs are ``[:-1]``, labels ``[1:]``). Global batch ``k`` is samples
``k*G ... k*G+G-1``; pipeline ``p`` takes the contiguous slice
``Layout.sample_range(p, micro_batch_size)`` of it, cut into micro-batches in order.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator, Protocol

import torch
import torch.distributed as dist

from elastor_mcore.parallel.layout import Layout


class SampleSource(Protocol):
    """Anything that yields the tokens of global sample ``index``."""

    def sample(self, index: int) -> torch.Tensor:
        """Token ids of sample ``index``: int64, shape ``[seq_length + 1]``."""
        ...

    def close(self) -> None:
        """Stop whatever prepares samples in the background."""
        ...


@dataclass(frozen=True)
class SyntheticTokens:
    """Deterministic random tokens: sample ``i`` comes from a generator seeded by
    (seed, i), so it is the same whichever rank, layout or restart asks for it."""

    vocab_size: int
    seq_length: int
    seed: int

    def sample(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return torch.randint(0, self.vocab_size, (self.seq_length + 1,), generator=generator)

    def close(self) -> None:
        """Nothing runs in the background; sources are closed alike after training."""


@dataclass(frozen=True)
class MicroBatch:
    tokens: torch.Tensor   # [micro_batch_size, seq_length] inputs
    labels: torch.Tensor   # [micro_batch_size, seq_length] next tokens


def pipeline_sample_indices(layout: Layout, pipeline: int, global_batch_size: int,
                            micro_batch_size: int, start_step: int = 0,
                            stop_step: int | None = None) -> Iterator[int]:
    """The global sample indices ``pipeline`` trains on, step by step from ``start_step``
    (e.g. consumed samples // global batch) to ``stop_step`` (None: forever)."""
    within = layout.sample_range(pipeline, micro_batch_size)
    steps = itertools.count(start_step) if stop_step is None else range(start_step, stop_step)
    for step in steps:
        first = step * global_batch_size
        yield from (first + i for i in within)


def pipeline_micro_batches(source: SampleSource, layout: Layout, pipeline: int, step: int,
                           global_batch_size: int, micro_batch_size: int) -> list[MicroBatch]:
    """The micro-batches pipeline ``pipeline`` trains on at ``step`` (0-based)."""
    indices = pipeline_sample_indices(layout, pipeline, global_batch_size, micro_batch_size,
                                      step, step + 1)
    return _cut(torch.stack([source.sample(i) for i in indices]), micro_batch_size)


def tp_shared_micro_batches(source: SampleSource, layout: Layout, pipeline: int, step: int,
                            global_batch_size: int, micro_batch_size: int, sample_length: int,
                            group: dist.ProcessGroup, device: torch.device) -> list[MicroBatch]:
    """``pipeline_micro_batches`` read once per TP group: the group's first rank reads them
    from ``source`` and broadcasts the tokens; the other ranks never touch their
    ``source``, so a stage runs one packing worker, not one per TP rank. Every rank of
    ``group`` calls this at the same step, before any other collective of the step;
    ``sample_length`` is ``seq_length + 1``. The micro-batches are on ``device``."""
    if dist.get_world_size(group) == 1:
        return pipeline_micro_batches(source, layout, pipeline, step, global_batch_size,
                                      micro_batch_size)
    if dist.get_rank(group) == 0:
        indices = pipeline_sample_indices(layout, pipeline, global_batch_size,
                                          micro_batch_size, step, step + 1)
        samples = torch.stack([source.sample(i) for i in indices]).to(device)
    else:
        count = len(layout.sample_range(pipeline, micro_batch_size))
        samples = torch.empty((count, sample_length), dtype=torch.int64, device=device)
    dist.broadcast(samples, group=group, group_src=0)
    return _cut(samples, micro_batch_size)


def _cut(samples: torch.Tensor, micro_batch_size: int) -> list[MicroBatch]:
    """Consecutive samples ``[n, seq_length + 1]`` as micro-batches, in order."""
    return [MicroBatch(tokens=chunk[:, :-1].contiguous(), labels=chunk[:, 1:].contiguous())
            for chunk in samples.split(micro_batch_size)]
