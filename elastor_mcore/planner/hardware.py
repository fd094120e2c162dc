"""Hardware profiles: the few numbers the cost model needs about a cluster, from YAML.

A profile describes one kind of node (all nodes of a cluster alike). Units are the ones
datasheets use, so a profile can be checked against its cited sources by eye:
TFLOP/s, GiB, GB/s (gigabytes) and microseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from elastor_mcore.config.yaml_file import read_yaml_file


class HardwareError(ValueError):
    """A hardware profile is missing, malformed or physically impossible."""


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    gpus_per_node: int
    memory_per_gpu_gib: float
    """Device memory of one GPU."""
    memory_reserved_gib: float
    """Memory no tensor can use: CUDA context, NCCL buffers, allocator fragmentation."""
    peak_tflops: float
    """Dense bf16 peak of one GPU."""
    efficiency_by_tp: dict[int, float]
    """Achieved fraction of peak in a layer's matrix multiplies, by TP degree (smaller
    shards run less efficiently). Degrees between two entries are interpolated linearly;
    degrees outside the table take the nearest entry."""
    intra_node_bandwidth_gb_s: float
    """Per-GPU, per-direction bandwidth inside a node (NVLink)."""
    inter_node_bandwidth_gb_s: float
    """Per-GPU, per-direction bandwidth between nodes (InfiniBand / RoCE)."""
    intra_node_latency_us: float = 10.0
    inter_node_latency_us: float = 20.0
    source: str = ""
    """Where the numbers come from (datasheets, papers); required for shipped profiles."""
    measured_layer_ms: dict[str, dict[int, float]] = field(default_factory=dict)
    """Optional measurements that replace the analytic compute term: recipe name ->
    TP degree -> milliseconds for forward+backward of one layer on one micro-batch."""

    def __post_init__(self) -> None:
        positive = ("gpus_per_node", "memory_per_gpu_gib", "peak_tflops",
                    "intra_node_bandwidth_gb_s", "inter_node_bandwidth_gb_s")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise HardwareError(f"hardware.{name} must be a positive number, got {value!r}")
        if not isinstance(self.gpus_per_node, int):
            raise HardwareError(f"hardware.gpus_per_node must be an integer, got "
                                f"{self.gpus_per_node!r}")
        for name in ("memory_reserved_gib", "intra_node_latency_us", "inter_node_latency_us"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise HardwareError(f"hardware.{name} must be a number >= 0, got {value!r}")
        if self.memory_reserved_gib >= self.memory_per_gpu_gib:
            raise HardwareError(
                f"hardware.memory_reserved_gib={self.memory_reserved_gib} leaves no memory of "
                f"memory_per_gpu_gib={self.memory_per_gpu_gib}; lower it")
        if not self.efficiency_by_tp:
            raise HardwareError("hardware.efficiency_by_tp needs at least one entry, "
                                "e.g. {1: 0.5, 8: 0.45}")
        for tp, eff in self.efficiency_by_tp.items():
            if not isinstance(tp, int) or tp <= 0 or not 0 < eff <= 1:
                raise HardwareError(
                    f"hardware.efficiency_by_tp[{tp!r}]={eff!r}: keys are TP degrees "
                    f"(positive integers), values fractions of peak in (0, 1]")
        for recipe, table in self.measured_layer_ms.items():
            for tp, ms in table.items():
                if not isinstance(tp, int) or tp <= 0 or not ms > 0:
                    raise HardwareError(
                        f"hardware.measured_layer_ms[{recipe!r}][{tp!r}]={ms!r}: keys are TP "
                        f"degrees, values positive milliseconds")

    def efficiency(self, tp: int) -> float:
        """Fraction of peak at TP degree ``tp`` (linear interpolation in the table)."""
        table = sorted(self.efficiency_by_tp.items())
        if tp <= table[0][0]:
            return table[0][1]
        for (t0, e0), (t1, e1) in zip(table, table[1:]):
            if tp <= t1:
                return e0 + (e1 - e0) * (tp - t0) / (t1 - t0)
        return table[-1][1]


def hardware_from_dict(data: Any, name: str = "hardware") -> HardwareProfile:
    if not isinstance(data, dict):
        raise HardwareError(f"{name}: a hardware profile is a mapping of fields")
    known = {f.name for f in fields(HardwareProfile)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise HardwareError(f"{name}: unknown field(s) {unknown}; known fields are "
                            f"{sorted(known)}")
    data = {"name": name, **data}
    try:
        data["efficiency_by_tp"] = {int(k): float(v)
                                    for k, v in (data.get("efficiency_by_tp") or {}).items()}
    except (AttributeError, TypeError, ValueError):
        raise HardwareError(f"{name}: efficiency_by_tp must map TP degrees to fractions, e.g. "
                            f"{{1: 0.55, 8: 0.5}}; got {data.get('efficiency_by_tp')!r}") from None
    try:
        data["measured_layer_ms"] = {
            str(recipe): {int(k): float(v) for k, v in table.items()}
            for recipe, table in (data.get("measured_layer_ms") or {}).items()}
    except (AttributeError, TypeError, ValueError):
        raise HardwareError(f"{name}: measured_layer_ms must map recipe names to "
                            f"{{tp: milliseconds}}, e.g. {{llama2-7b: {{8: 41.0}}}}; got "
                            f"{data.get('measured_layer_ms')!r}") from None
    try:
        return HardwareProfile(**data)
    except TypeError as exc:
        raise HardwareError(f"{name}: {exc}") from None


def load_hardware(path: str | Path) -> HardwareProfile:
    """Read a hardware profile YAML file; errors name the file and the field."""
    data = read_yaml_file(path, "hardware profile", HardwareError)
    return hardware_from_dict(data, name=Path(path).stem)
