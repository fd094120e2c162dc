"""Hardware profiles: the few numbers the cost model needs about a cluster, from YAML.

A profile describes one kind of node (all nodes of a cluster alike). Units are the ones
datasheets use, so a profile can be checked against its cited sources by eye:
TFLOP/s, GiB, GB/s (gigabytes) and microseconds.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from elastor_mcore.config.recipe import Recipe
from elastor_mcore.config.shipped import find_input
from elastor_mcore.config.yaml_file import read_yaml_file

log = logging.getLogger(__name__)


class HardwareError(ValueError):
    """A hardware profile is missing, malformed or physically impossible."""


@dataclass(frozen=True)
class StageTable:
    """One measured quantity of a stage at one TP degree, in the parts the cost model
    adds up: a stage of ``n`` layers costs ``stage + n x layer``, plus ``embedding`` if
    it is the first stage and ``output`` (output layer and loss) if it is the last."""

    layer: float
    stage: float
    embedding: float
    output: float

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise HardwareError(f"{f.name} must be a number >= 0, got {value!r}")

    def total(self, layers: int, first: bool, last: bool) -> float:
        return self.stage + layers * self.layer + first * self.embedding + last * self.output


@dataclass(frozen=True)
class RecipeMeasurements:
    """What ``elastor profile`` measured for one recipe on this hardware."""

    shape: dict[str, Any]
    """The recipe's model (without ``num_layers``), micro-batch size and dtype: the
    tables hold for recipes of exactly this shape."""
    forward_backward_ms: dict[int, StageTable]
    """Forward + backward of one micro-batch, by TP degree, on a slot that has a core
    to itself (``HardwareProfile.concurrent_slots`` says how runs share them)."""
    activation_mib: dict[int, StageTable]
    """Bytes autograd keeps for backward per micro-batch (MiB), by TP degree."""
    state_mib: dict[int, StageTable]
    """Parameters, gradients and optimizer state per GPU (MiB), by TP degree."""
    cpu_ms: dict[int, StageTable] = field(default_factory=dict)
    """CPU time of forward + backward of one micro-batch, summed over the stage's TP
    group, by TP degree: what the stage takes from cores other slots share (a rank
    waiting in a collective does not compute). Absent: the wall time of every rank."""
    optimizer_ns_per_param: float | None = None
    """Wall (= CPU) time of the loop's optimizer step per local parameter, in the
    recipe's dtype. Absent: the step's optimizer is not charged."""
    measured_on: dict[str, Any] = field(default_factory=dict)
    """Host, date, device, torch and megatron-core versions, recipe file, repeats."""

    @property
    def tp_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.forward_backward_ms))


def recipe_shape(recipe: Recipe) -> dict[str, Any]:
    """What a measurement depends on: the layer's shape, micro-batch and dtype."""
    model = {k: v for k, v in asdict(recipe.model).items() if k != "num_layers"}
    return {**model, "micro_batch_size": recipe.training.micro_batch_size,
            "params_dtype": recipe.training.params_dtype}


def _positions_set(shape: dict[str, Any]) -> dict[str, Any]:
    """``shape`` with an unset ``max_position_embeddings`` as the sequence length (what
    the model is built with; Megatron-LM's arguments always set it)."""
    return {**shape, "max_position_embeddings": shape.get("max_position_embeddings")
            or shape.get("seq_length")}


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
    p2p_latency_us: float | None = None
    p2p_bandwidth_gb_s: float | None = None
    """Measured point-to-point messages inside a node (absent: the intra-node link)."""
    concurrent_slots: float | None = None
    """CPU slots: how many worker processes of one machine compute at full speed at
    once (they share its cores; every slot of a CPU run is on that machine). A run of
    ``n`` busy slots takes ``max(1, n / concurrent_slots)`` times as long as on
    ``n`` independent devices. Absent for GPUs: each computes on its own."""
    concurrency: dict[int, float] = field(default_factory=dict)
    """CPU slots, measured: ``{k: cores' worth}`` that ``k`` slots busy at once
    achieve (``k x`` one slot's step time alone over each one's with ``k`` busy).
    Replaces ``concurrent_slots`` (its value at the most slots) where present: a
    layout with ``d`` slots busy on average runs at ``cores_worth(d)``."""
    measured: dict[str, RecipeMeasurements] = field(default_factory=dict)
    """``elastor profile``'s tables by recipe name; they replace the analytic stage
    times and per-layer memory for a recipe of the same shape."""

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
        for name in ("p2p_latency_us", "p2p_bandwidth_gb_s", "concurrent_slots"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool)
                                      or not isinstance(value, (int, float)) or value <= 0):
                raise HardwareError(f"hardware.{name} must be a positive number or absent, "
                                    f"got {value!r}")
        for k, worth in self.concurrency.items():
            if not isinstance(k, int) or k <= 0 or not 0 < worth <= k:
                raise HardwareError(
                    f"hardware.concurrency[{k!r}]={worth!r}: keys are numbers of busy slots, "
                    f"values the cores' worth they achieve, in (0, slots]")
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

    def measurements_for(self, recipe: Recipe) -> RecipeMeasurements | None:
        """The measured tables for ``recipe`` if they were taken on its shape; a recipe
        the profile has no measurements of by name (e.g. one translated from Megatron-LM's
        arguments) takes those of a recipe of its shape."""
        shape = _positions_set(recipe_shape(recipe))
        found = self.measured.get(recipe.name)
        if found is None:
            return next((m for m in self.measured.values()
                         if _positions_set(m.shape) == shape), None)
        if _positions_set(found.shape) != shape:
            changed = sorted(k for k in set(found.shape) | set(recipe_shape(recipe))
                             if found.shape.get(k) != recipe_shape(recipe).get(k))
            log.warning("hardware profile %s: the measurements of %s were taken on another "
                        "shape (%s differ); using the analytic model. Run elastor profile "
                        "again for this recipe.", self.name, recipe.name, ", ".join(changed))
            return None
        return found

    def to_dict(self) -> dict[str, Any]:
        """The YAML mapping ``hardware_from_dict`` reads back (without ``name``)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "name" and value is not None and value != {}:
                out[f.name] = value
        if self.measured:
            out["measured"] = {name: {k: v for k, v in asdict(m).items()
                                      if v is not None and v != {}}
                               for name, m in self.measured.items()}
        return out

    def cores_worth(self, busy: float) -> float | None:
        """Cores' worth that ``busy`` slots computing at once achieve on average (None:
        devices of their own). Linear between the measured ``concurrency`` points (and
        ``(1, 1)``: one slot alone is the unit), the last point beyond them; without the
        table, ``min(busy, concurrent_slots)``."""
        if not self.concurrency:
            return None if not self.concurrent_slots else min(busy, self.concurrent_slots)
        points = sorted({1: 1.0, **self.concurrency}.items())
        if busy <= 1:
            return busy
        for (k0, w0), (k1, w1) in zip(points, points[1:]):
            if busy <= k1:
                return w0 + (w1 - w0) * (busy - k0) / (k1 - k0)
        return points[-1][1]

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
        data["concurrency"] = {int(k): float(v)
                               for k, v in (data.get("concurrency") or {}).items()}
    except (AttributeError, TypeError, ValueError):
        raise HardwareError(f"{name}: concurrency must map numbers of busy slots to cores' "
                            f"worth, e.g. {{2: 1.9, 4: 1.8}}; got "
                            f"{data.get('concurrency')!r}") from None
    data["measured"] = {str(recipe): _measurements(table, f"{name}: measured[{recipe!r}]")
                        for recipe, table in (data.get("measured") or {}).items()}
    try:
        return HardwareProfile(**data)
    except TypeError as exc:
        raise HardwareError(f"{name}: {exc}") from None


TABLES = ("forward_backward_ms", "activation_mib", "state_mib")
OPTIONAL_TABLES = ("cpu_ms",)


def _measurements(data: Any, where: str) -> RecipeMeasurements:
    if not isinstance(data, dict):
        raise HardwareError(f"{where} must be a mapping (written by elastor profile)")
    missing = sorted({"shape", *TABLES} - set(data))
    unknown = sorted(set(data) - {f.name for f in fields(RecipeMeasurements)})
    if missing or unknown:
        raise HardwareError(f"{where}: missing {missing}, unknown {unknown}; measure again "
                            f"with elastor profile")
    tables = {}
    for key in TABLES + tuple(k for k in OPTIONAL_TABLES if k in data):
        try:
            tables[key] = {int(tp): StageTable(**parts) for tp, parts in data[key].items()}
        except (AttributeError, TypeError, ValueError, HardwareError) as exc:
            raise HardwareError(f"{where}.{key}: {exc}; each TP degree maps to "
                                f"{{layer, stage, embedding, output}}") from None
    if any(set(t) != set(tables["forward_backward_ms"]) for t in tables.values()):
        raise HardwareError(f"{where}: the tables cover different TP degrees")
    per_param = data.get("optimizer_ns_per_param")
    if per_param is not None and (isinstance(per_param, bool)
                                  or not isinstance(per_param, (int, float)) or per_param < 0):
        raise HardwareError(f"{where}.optimizer_ns_per_param must be a number >= 0 or absent, "
                            f"got {per_param!r}")
    return RecipeMeasurements(shape=dict(data["shape"]), measured_on=dict(
        data.get("measured_on") or {}), optimizer_ns_per_param=per_param, **tables)


def write_hardware(profile: HardwareProfile, path: str | Path, header: str = "") -> None:
    """Write ``profile`` as YAML (``header`` lines become comments at the top)."""
    comments = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    Path(path).write_text(comments + yaml.safe_dump(profile.to_dict(), sort_keys=False,
                                                    width=88))


def load_hardware(path: str | Path) -> HardwareProfile:
    """Read a hardware profile YAML file, or the shipped profile of that name
    (``h100-80gb``); errors name the file and the field."""
    path = find_input(path, "hardware profile")
    data = read_yaml_file(path, "hardware profile", HardwareError,
                          shipped_kind="hardware profile")
    return hardware_from_dict(data, name=path.stem)
