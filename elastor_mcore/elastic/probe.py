"""Which devices survived a failure.

CUDA: each candidate device runs a small kernel in its own subprocess under a
timeout (``runtime.device_probe``), so a wedged device stalls only its probe.
CPU: a "device" is a rank slot and cannot break; the slots whose failure was injected
count as dead (``alive_slots``), which is also how an injected failure on CUDA stands
for a dead GPU.
"""

from __future__ import annotations

from typing import Iterable, Sequence


def alive_slots(slots: Sequence[int], dead: Iterable[int]) -> list[int]:
    """The slots not known dead."""
    dead = set(dead)
    return [s for s in slots if s not in dead]
