"""Let Megatron-Core run on CPU (gloo) where it hard-codes CUDA.

Applied only when CUDA is absent (``apply_if_needed``). It covers exactly what the
runtime hits on CPU:

* ``torch.cuda.current_device()`` is used as a ``device=`` argument for buffers
  (receive buffers, the global memory buffer, vocab-parallel logits); on CPU it
  returns ``"cpu"``.
* ``torch.cuda.synchronize()`` becomes a no-op.
* mcore's CUDA RNG tracker (``get_cuda_rng_tracker().fork()`` around TP-sharded
  initialisation and dropout) is replaced by one that forks CPU generator states.
* activation recomputation (``tensor_parallel.checkpoint``) saves and restores the
  CUDA generator's state beside the CPU one; on CPU there is none to keep.

Causal masks are passed explicitly by the runtime (mcore's default mask is built on
CUDA), so no shim is needed for them.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch

log = logging.getLogger(__name__)

_applied = False


class CPURNGTracker:
    """Stands in for ``CudaRNGStatesTracker``: named CPU generator states."""

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise RuntimeError(f"RNG state {name!r} already exists")
        self.states[name] = torch.Generator().manual_seed(seed).get_state()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = dict(states)

    def reset(self) -> None:
        self.states = {}

    def is_initialized(self) -> bool:
        return True

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        saved = torch.get_rng_state()
        if name in self.states:
            torch.set_rng_state(self.states[name])
        try:
            yield
        finally:
            if name in self.states:
                self.states[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


def apply() -> None:
    """Install the shims (idempotent)."""
    global _applied
    if _applied:
        return
    from megatron.core.tensor_parallel import random as tp_random

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    tp_random._CUDA_RNG_STATE_TRACKER = CPURNGTracker()
    tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    tp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    tp_random._set_cuda_rng_state = lambda *args, **kwargs: None
    _applied = True
    log.debug("Megatron-Core CPU shims applied")


def apply_if_needed() -> bool:
    """Apply the shims when CUDA is not available; return whether they are active."""
    if torch.cuda.is_available():
        return False
    apply()
    return True
