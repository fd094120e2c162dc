"""Where a rank's tensors sit in the global ones, from mcore's ``sharded_state_dict()``.

Tensor identity comes from mcore's ShardedTensors (per-layer keys, SwiGLU ``fc1``
split into its ``_w``/``_v`` halves by ``apply_factories``), never from parameter
names. Everything that must not depend on the layout goes through this module:
initialisation, gradient reduction, the gradient norm, and the checkpoint.
"""

from __future__ import annotations

from typing import Iterable

import torch

from elastor_mcore.geometry import Box, ShardInfo

SHARDED_METADATA = {"singleton_local_shards": True}
"""Per-layer keys: with stacked layer keys a heterogeneous layout's shards overlap."""


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


def gather_shard_infos(local: Iterable[ShardInfo], group=None) -> dict[int, list[ShardInfo]]:
    """All ranks' shard descriptions (one ``all_gather_object``), keyed by global rank."""
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(group) if group is not None else \
        list(range(dist.get_world_size()))
    gathered: list = [None] * len(ranks)
    dist.all_gather_object(gathered, list(local), group=group)
    return dict(zip(ranks, gathered))
