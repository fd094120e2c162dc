"""Global-tensor geometry of a rank's state, taken from mcore's ``sharded_state_dict()``.

Tensor identity comes from mcore's ShardedTensors (per-layer keys, SwiGLU ``fc1``
split into its ``_w``/``_v`` halves by ``apply_factories``), never from parameter
names. Everything that must not depend on the layout goes through this module:
initialisation, gradient reduction, the gradient norm, and the checkpoint.

The key operation is the *common refinement*: given the boxes every rank holds of
every global tensor, cut each tensor into cells such that every cell is either wholly
inside or wholly outside each rank's box. Each cell then has a fixed set of holders.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

SHARDED_METADATA = {"singleton_local_shards": True}
"""Per-layer keys: with stacked layer keys a heterogeneous layout's shards overlap."""


@dataclass(frozen=True)
class Box:
    """An axis-aligned region of a global tensor: ``offset`` and ``shape`` per dim."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def end(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offset, self.shape))

    def contains(self, other: "Box") -> bool:
        return all(o <= oo and oo + os <= o + s
                   for o, s, oo, os in zip(self.offset, self.shape, other.offset, other.shape))

    def intersect(self, other: "Box") -> "Box | None":
        lo = tuple(max(a, b) for a, b in zip(self.offset, other.offset))
        hi = tuple(min(a, b) for a, b in zip(self.end, other.end))
        if any(h <= l for l, h in zip(lo, hi)):
            return None
        return Box(lo, tuple(h - l for l, h in zip(lo, hi)))

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offset, self.shape))


@dataclass(frozen=True)
class ShardInfo:
    """Picklable description of one local shard of a global tensor."""

    key: str
    global_shape: tuple[int, ...]
    box: Box
    dtype: str


def sharded_tensors(model: torch.nn.Module) -> list:
    """The model's ShardedTensors (per-layer keys, factories applied), sorted by key.

    ShardedObjects (``_extra_state``) carry nothing for these models and are dropped.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    state = model.sharded_state_dict(metadata=dict(SHARDED_METADATA))
    apply_factories(state)
    found = [v for v in nested_values(state) if isinstance(v, ShardedTensor)]
    return sorted(found, key=lambda st: st.key)


def shard_info(st) -> ShardInfo:
    return ShardInfo(
        key=st.key,
        global_shape=tuple(st.global_shape),
        box=Box(tuple(st.global_offset), tuple(st.local_shape)),
        dtype=str(st.dtype).replace("torch.", ""),
    )


def owning_parameter(model: torch.nn.Module, data: torch.Tensor) -> torch.nn.Parameter:
    """The parameter whose storage ``data`` (a ShardedTensor's data) is a view of."""
    ptr = data.untyped_storage().data_ptr()
    for p in model.parameters():
        if p.untyped_storage().data_ptr() == ptr:
            return p
    raise KeyError("sharded tensor data is not a view of any parameter of the model")


def view_like(data: torch.Tensor, param: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """The part of ``other`` (laid out like ``param``: its grad, an Adam moment) that
    corresponds to ``data``, a view into ``param``."""
    if other.shape != param.shape or other.stride() != param.stride():
        raise ValueError("tensor is not laid out like the parameter")
    offset = data.storage_offset() - param.storage_offset() + other.storage_offset()
    return other.as_strided(data.shape, data.stride(), offset)


def local_view(tensor: torch.Tensor, held: Box, cell: Box) -> torch.Tensor:
    """The part of a local shard ``tensor`` (covering ``held``) that is ``cell``."""
    for dim, (co, ho, size) in enumerate(zip(cell.offset, held.offset, cell.shape)):
        tensor = tensor.narrow(dim, co - ho, size)
    return tensor


@dataclass(frozen=True)
class Cell:
    """A piece of a global tensor held, whole, by exactly the ranks in ``holders``."""

    key: str
    box: Box
    holders: tuple[int, ...]


def common_refinement(infos_by_rank: dict[int, Sequence[ShardInfo]]) -> list[Cell]:
    """Cut every global tensor into cells along every rank's shard boundaries.

    Deterministic: every rank computing it from the same gathered input gets the same
    list, in the same order (by key, then cell offset).
    """
    boxes: dict[str, list[tuple[int, Box]]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for rank in sorted(infos_by_rank):
        for info in infos_by_rank[rank]:
            if shapes.setdefault(info.key, info.global_shape) != info.global_shape:
                raise ValueError(
                    f"ranks disagree on the global shape of {info.key}: "
                    f"{shapes[info.key]} vs {info.global_shape}")
            boxes.setdefault(info.key, []).append((rank, info.box))
    cells = []
    for key in sorted(boxes):
        held = boxes[key]
        ndim = len(shapes[key])
        cuts = []
        for dim in range(ndim):
            points = {0, shapes[key][dim]}
            for _, box in held:
                points.update((box.offset[dim], box.end[dim]))
            cuts.append(sorted(points))
        intervals = [list(zip(c[:-1], c[1:])) for c in cuts]
        for combo in itertools.product(*intervals):
            box = Box(tuple(lo for lo, _ in combo), tuple(hi - lo for lo, hi in combo))
            holders = tuple(sorted({r for r, b in held if b.contains(box)}))
            if holders:
                cells.append(Cell(key, box, holders))
    return cells


def gather_shard_infos(local: Iterable[ShardInfo], group=None) -> dict[int, list[ShardInfo]]:
    """All ranks' shard descriptions (one ``all_gather_object``), keyed by global rank."""
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(group) if group is not None else \
        list(range(dist.get_world_size()))
    gathered: list = [None] * len(ranks)
    dist.all_gather_object(gathered, list(local), group=group)
    return dict(zip(ranks, gathered))
