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

Start-up is measured apart (``AllocationMeter``, ``rss_high_water``): the peak bytes of
the tensors a piece of start-up code (building the optimizer) allocates, and those it
keeps; on CPU torch keeps no allocator statistics, so they are counted on the tensors.
"""

from __future__ import annotations

import resource
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from elastor_mcore.planner.cost_model import MemoryBreakdown

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_RESET_HIGH_WATER = "5"
"""``clear_refs``' value that resets the peak resident set (Linux 4.0+)."""


class LiveStorages:
    """Bytes of the storages added and not yet released, each counted once however many
    tensors refer to it, and their peak."""

    def __init__(self) -> None:
        self._live: dict[int, list[int]] = {}  # storage -> [references, bytes]
        self.current = 0
        self.peak = 0

    def __contains__(self, key: int) -> bool:
        return key in self._live

    def add(self, key: int, nbytes: int) -> None:
        """One more reference to storage ``key`` of ``nbytes`` bytes."""
        entry = self._live.setdefault(key, [0, nbytes])
        if entry[0] == 0:
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1

    def release(self, key: int) -> None:
        """One reference fewer; the storage's bytes go with the last."""
        entry = self._live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self._live[key]


class _Saved:
    """A saved tensor, releasing its storage in the meter when autograd drops it."""

    __slots__ = ("storages", "key", "tensor")

    def __init__(self, storages: LiveStorages, key: int, tensor: torch.Tensor) -> None:
        self.storages, self.key, self.tensor = storages, key, tensor

    def __del__(self) -> None:
        self.storages.release(self.key)


class SavedTensorMeter(LiveStorages):
    """Counts the bytes autograd saves for backward while it is active (a
    ``saved_tensors_hooks`` context) and keeps their peak."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self._skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._skip or storage.nbytes() == 0:
            return tensor
        self.add(key, storage.nbytes())
        return _Saved(self, key, tensor)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def __enter__(self) -> "SavedTensorMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


class AllocationMeter(TorchDispatchMode, LiveStorages):
    """Counts the bytes of the tensors allocated while it is active (every op's new
    storages, each once; tensors that existed before and views of them left out) that
    are still alive: ``current`` now, ``peak`` at its highest. Measures one piece of
    start-up code, such as building an optimizer: slow, never for training steps."""

    def __init__(self) -> None:
        TorchDispatchMode.__init__(self)
        LiveStorages.__init__(self)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._track(tensor, inputs)
        return out

    def _track(self, tensor: torch.Tensor, inputs: set[int]) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or (key in inputs and key not in self):
            return
        self.add(key, storage.nbytes())
        weakref.finalize(tensor, self.release, key)


def rss_high_water() -> int | None:
    """The process's peak resident set since it started or since the last
    ``reset_rss_high_water`` (``VmHWM``, bytes); None where /proc has none."""
    try:
        lines = _STATUS.read_text().splitlines()
    except OSError:
        return None
    kib = next((line.split()[1] for line in lines if line.startswith("VmHWM:")), None)
    return int(kib) * 1024 if kib is not None else None


def reset_rss_high_water() -> bool:
    """Start ``rss_high_water`` again from the resident set now, to measure one phase
    (a training step) apart from start-up; False where the kernel does not allow it."""
    try:
        _CLEAR_REFS.write_text(_RESET_HIGH_WATER)
    except OSError:
        return False
    return True


class PhaseHighWater:
    """The RSS high-water of one phase (a training step) apart from start-up, as a
    context: ``phase`` (None where the high-water cannot be reset) and ``process``, the
    process's over its whole life."""

    phase: int | None = None
    process: int = 0

    def __enter__(self) -> "PhaseHighWater":
        self._before = rss_peak_bytes()
        self._reset = reset_rss_high_water()
        return self

    def __exit__(self, *exc) -> None:
        self.phase = rss_high_water() if self._reset else None
        self.process = max(self._before, rss_peak_bytes())


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s weights and of the gradient buffers they have now (fp32
    ``main_grad`` where mixed precision made one, ``.grad`` where it exists)."""
    return sum(p.nbytes + sum(g.nbytes for g in (getattr(p, "main_grad", None), p.grad)
                              if g is not None)
               for p in model.parameters())


@dataclass(frozen=True)
class StartupMemory:
    """A rank's memory once its optimizer is built."""

    before: int
    """Bytes of its weights and gradient buffers before the optimizer was built."""
    built_peak: int
    """Bytes of the tensors allocated while the optimizer was built, at their peak."""
    built_kept: int
    """...of which still alive once it was built: the optimizer's own tensors."""
    rss_peak: int | None
    """The process's RSS high-water once it was built (bytes; None: not measurable)."""

    @property
    def peak(self) -> int:
        """Bytes of the rank's tensors at the build's peak."""
        return self.before + self.built_peak

    @classmethod
    def measured(cls, before: int, meter: AllocationMeter) -> "StartupMemory":
        """From ``meter``, which was active while the optimizer was built, now."""
        return cls(before, meter.peak, meter.current, rss_high_water())


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
    startup: StartupMemory | None = None
    step_rss_peak: int | None = None  # bytes, RSS high-water of the measured step alone


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


def startup_table(reports: list[RankMemory], when: str) -> list[str]:
    """Each rank's start-up peak beside its steady state and the planner's prediction
    (MiB): the tensors allocated building the optimizer (peak, kept), start-up (the
    weights and gradient buffers held before + that peak) against the step's measured
    total, and the process's RSS high-water through start-up and during the step alone."""
    mib = 2**20

    def figure(value: float | None, width: int, digits: int = 3) -> str:
        return f"{value / mib:{width}.{digits}f}" if value is not None else f"{'-':>{width}}"

    lines = [f"start-up against the steady state ({when}) per rank (MiB): tensors "
             f"allocated building the optimizer, at their peak and kept; start-up "
             f"(weights and gradients held before + that peak) against the step's total and "
             f"the planner's; RSS high-water through start-up and during the step:",
             f"  {'rank':>4}  {'stage':<11}{'build peak':>11}{'kept':>9}{'start-up':>10}"
             f"{'steady':>9}{'planner':>9}{'RSS start':>11}{'RSS step':>10}"]
    for m in reports:
        if m.startup is None:
            continue
        lines.append(
            f"  {m.rank:>4}  {m.where:<11}{figure(m.startup.built_peak, 11)}"
            f"{figure(m.startup.built_kept, 9)}{figure(m.startup.peak, 10)}"
            f"{figure(m.measured.total, 9)}"
            f"{figure(m.predicted.total if m.predicted else None, 9)}"
            f"{figure(m.startup.rss_peak, 11, 1)}{figure(m.step_rss_peak, 10, 1)}")
    return lines
