"""The memory a rank uses, measured, beside the planner's prediction (``--report-memory``).

Measured on the rank's own tensors, in the planner's terms (``cost_model.MemoryBreakdown``):

* weights: its parameters, in the params dtype;
* gradients: the buffers gradients accumulate in (fp32 ``main_grad`` in bf16 runs,
  ``.grad`` otherwise);
* optimizer: what AdamW holds besides the weights: its moments, and the fp32 main
  parameters where they are copies (bf16, or ZeRO-1's shards);
* activations: the peak bytes of the tensors autograd saved for backward during one
  training step (``SavedTensorMeter``), each storage counted once and parameters left
  out: what 1F1B's in-flight micro-batches keep, recomputation included;
* the process as the OS sees it: RSS high-water (``getrusage``: the interpreter, torch
  and mcore included) and, on CUDA, the caching allocator's peak.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

import torch

from elastor_mcore.planner.cost_model import MemoryBreakdown


class _Saved:
    """A saved tensor, releasing its storage's count in the meter when autograd drops it."""

    __slots__ = ("meter", "key", "tensor")

    def __init__(self, meter: "SavedTensorMeter", key: int, tensor: torch.Tensor) -> None:
        self.meter, self.key, self.tensor = meter, key, tensor

    def __del__(self) -> None:
        self.meter.release(self.key)


class SavedTensorMeter:
    """Counts the bytes autograd saves for backward while it is active (a
    ``saved_tensors_hooks`` context) and keeps their peak."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._live: dict[int, list[int]] = {}  # storage -> [saved tensors, bytes]
        self.current = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._skip or storage.nbytes() == 0:
            return tensor
        entry = self._live.setdefault(key, [0, storage.nbytes()])
        if entry[0] == 0:
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        return _Saved(self, key, tensor)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def release(self, key: int) -> None:
        entry = self._live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self._live[key]

    def __enter__(self) -> "SavedTensorMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


@dataclass(frozen=True)
class RankMemory:
    """One rank's measured memory after a training step, and the planner's prediction
    for its stage (None without a hardware profile)."""

    rank: int
    where: str                      # "P<pipeline>.S<stage>.tp<rank>"
    measured: MemoryBreakdown
    rss_peak: int                   # bytes, the process's high-water resident set
    device_peak: int | None         # bytes, CUDA allocator peak (None on CPU)
    predicted: MemoryBreakdown | None  # without the profile's reserve


def measure(model: torch.nn.Module, adamw: torch.optim.Optimizer, grads: list[torch.Tensor],
            activations_peak: int) -> MemoryBreakdown:
    """The rank's tensors now: ``grads`` are its gradient buffers, ``adamw`` the AdamW
    whose state is counted (its parameters that are the model's own are weights)."""
    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    optimizer = 0
    for group in adamw.param_groups:
        for p in group["params"]:
            if p.untyped_storage().data_ptr() not in own:
                optimizer += p.nbytes
            optimizer += sum(v.nbytes for k, v in adamw.state[p].items()
                             if k != "step" and torch.is_tensor(v))
    return MemoryBreakdown(weights=sum(p.nbytes for p in model.parameters()),
                     gradients=sum(g.nbytes for g in grads if g is not None),
                     optimizer=optimizer, activations=activations_peak)


def rss_peak_bytes() -> int:
    """High-water resident set of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def device_peak_bytes(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def memory_table(reports: list[RankMemory], when: str = "after step 1") -> list[str]:
    """``--report-memory``'s table: each rank's measured memory beside the planner's
    prediction for its stage, in MiB, and how far apart the totals are."""
    mib = 2**20
    kinds = ("weights", "gradients", "optimizer", "activations")
    device = reports[0].device_peak is not None
    lines = [f"memory per rank {when}, measured / planner (MiB); activations: peak "
             f"saved for backward; RSS: the process's high-water, libraries included:",
             f"  {'rank':>4}  {'stage':<11}" + "".join(f"{k:>20}" for k in kinds)
             + f"{'total':>20}{'RSS':>9}" + (f"{'CUDA peak':>11}" if device else "")]
    for m in reports:
        line = f"  {m.rank:>4}  {m.where:<11}"
        for kind in (*kinds, "total"):
            measured = getattr(m.measured, kind) / mib
            predicted = f"{getattr(m.predicted, kind) / mib:8.3f}" if m.predicted else "       -"
            line += f"  {measured:8.3f} /{predicted}"
        line += f"{m.rss_peak / mib:9.0f}"
        if m.device_peak is not None:
            line += f"{m.device_peak / mib:11.1f}"
        if m.predicted:
            line += f"   total {m.measured.total / m.predicted.total - 1:+.0%}"
        lines.append(line)
    return lines
