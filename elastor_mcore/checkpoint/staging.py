"""Host buffers for the blocking part of an asynchronous save.

The caller must be free to update its tensors as soon as ``save`` returns, so the
units a rank writes are first copied into one host buffer. The buffer is allocated
once and reused by every later save of the same plan (pinned when the state lives on
a GPU, so the device-to-host copies run at full PCIe speed); each unit gets a
contiguous slice, which is also the cheapest thing for TensorStore to write from.
"""

from __future__ import annotations

import logging

import torch

from elastor_mcore.checkpoint.writer import Sources

log = logging.getLogger(__name__)

_ALIGN = 64
"""Byte alignment of each unit's slice (cache line; a multiple of every itemsize)."""


class HostStaging:
    """One reusable host buffer holding copies of a rank's units."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def stage(self, sources: Sources) -> Sources:
        """Copy every source into the buffer; returns the units with their copies.

        The copies are complete on return (device copies are synchronised).
        """
        offsets, total = [], 0
        for unit, _ in sources:
            offsets.append(total)
            total += -(-unit.nbytes // _ALIGN) * _ALIGN
        on_device = any(data.device.type != "cpu" for _, data in sources)
        self._ensure(total, pin=on_device)
        staged = []
        for (unit, data), offset in zip(sources, offsets):
            raw = self._buffer[offset:offset + unit.nbytes]
            copy = raw.view(data.dtype).view(data.shape)
            copy.copy_(data, non_blocking=on_device)
            staged.append((unit, copy))
        if on_device:
            torch.cuda.synchronize()
        return staged

    def _ensure(self, nbytes: int, pin: bool) -> None:
        buffer = self._buffer
        if buffer is not None and buffer.numel() >= nbytes and buffer.is_pinned() == pin:
            return
        log.info("allocating a %s host staging buffer of %d bytes",
                 "pinned" if pin else "pageable", nbytes)
        self._buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
