"""Save and load any mcore ``sharded_state_dict()`` in the elastor format.

The mapping from modules to global tensors is mcore's own: factories are applied
(SwiGLU ``linear_fc1`` becomes its ``_w``/``_v`` halves) and each ``ShardedTensor``
becomes a ``LocalShard`` from its ``global_shape`` / ``global_offset``. Replicas need no
``replica_id`` bookkeeping: the writer deduplicates by geometry.

``ShardedObject``s: main replicas whose data is plain JSON (``None``, numbers,
strings, lists, dicts) are stored in the manifest under their ``unique_key``; others
(bytes, tensors, ``BytesIO`` extra state) are skipped with a logged warning, because
the format is pickle-free. Non-sharded values in the state dict are not stored.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from elastor_mcore.checkpoint import comm
from elastor_mcore.checkpoint.format import CheckpointError, ChunkPolicy
from elastor_mcore.checkpoint.plan import NO_REPLICAS, LocalShard, Replicas
from elastor_mcore.checkpoint.reader import load
from elastor_mcore.checkpoint.writer import SaveResult, write_checkpoint

log = logging.getLogger(__name__)


def save_sharded_state_dict(sharded_state_dict: dict, path: str | os.PathLike, *,
                            step: int = 0, manifest_extra: dict[str, Any] | None = None,
                            group=None, chunking: ChunkPolicy | None = None,
                            replicas: Replicas = NO_REPLICAS) -> SaveResult:
    """Save into exactly ``path`` (like ``dist_checkpointing.save``), atomically.
    ``replicas``: which ranks hold the same tensors (``checkpoint.Replicas``).

    Applies factories in place, as ``dist_checkpointing.save`` does.
    """
    from megatron.core.dist_checkpointing.mapping import apply_factories

    apply_factories(sharded_state_dict)
    shards, objects = _collect(sharded_state_dict)
    stored: dict[str, Any] = {}
    for rank_objects in comm.all_gather(_json_objects(objects), group):
        stored.update(rank_objects)
    extra = dict(manifest_extra or {})
    extra["objects"] = {**extra.get("objects", {}), **stored}
    return write_checkpoint(path, step, shards, extra, group, chunking, replicas=replicas)


def local_shards(sharded_state_dict: dict) -> list[LocalShard]:
    """The ShardedTensors of a state dict whose factories are applied and whose
    ShardedObjects were taken out (``megatron_dir`` stores those as files), as
    ``LocalShard``s."""
    shards, objects = _collect(sharded_state_dict)
    if objects:
        raise ValueError(f"{len(objects)} ShardedObject(s), e.g. {objects[0].unique_key}, "
                         f"left among the tensors; take them out first")
    return shards


def load_sharded_state_dict(sharded_state_dict: dict, path: str | os.PathLike, *,
                            group=None, replicas: Replicas = NO_REPLICAS) -> dict:
    """Fill the state dict's tensors in place from ``path`` (a step directory or a
    root) and return it with plain values, factories merged (like
    ``dist_checkpointing.load``); ``replicas`` as ``checkpoint.load`` takes them."""
    from megatron.core.dist_checkpointing.dict_utils import (
        dict_list_map_inplace, extract_matching_values)
    from megatron.core.dist_checkpointing.mapping import (
        LocalNonpersistentObject, ShardedBase, ShardedTensorFactory, apply_factories,
        apply_factory_merges)

    # Lists as {index: value}, as mcore's load_preprocess: a list whose factories sit
    # in some items only (an optimizer's param groups) keeps their positions.
    factories, _ = extract_matching_values(
        sharded_state_dict, lambda x: isinstance(x, ShardedTensorFactory),
        return_lists_as_dicts=True)
    apply_factories(sharded_state_dict)
    shards, objects = _collect(sharded_state_dict)
    manifest = load(path, shards, group, replicas)
    for obj in objects:
        if obj.unique_key in manifest.objects:
            obj.data = manifest.objects[obj.unique_key]
        else:
            log.warning("ShardedObject %s is not in the checkpoint; keeping its current "
                        "value", obj.unique_key)

    def unwrap(x):
        if isinstance(x, ShardedBase):
            return x.data
        if isinstance(x, LocalNonpersistentObject):
            return x.unwrap()
        return x

    dict_list_map_inplace(unwrap, sharded_state_dict)
    return apply_factory_merges(sharded_state_dict, factories)


def _collect(sharded_state_dict: dict) -> tuple[list[LocalShard], list]:
    """The state dict's ShardedTensors as LocalShards, and its ShardedObjects."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    shards, objects = [], []
    for value in nested_values(sharded_state_dict):
        if isinstance(value, ShardedObject):
            objects.append(value)
        elif isinstance(value, ShardedTensor):
            shards.append(_local_shard(value))
    return shards, objects


def _local_shard(st) -> LocalShard:
    if getattr(st, "flattened_range", None) is not None:
        raise CheckpointError(
            f"tensor {st.key}: flattened_range shards (legacy distributed optimizer) are "
            f"not supported; use the fully reshardable optimizer state")
    if st.data is None:
        st.init_data("cpu")
    # Prepended axes (stacked layers) are size-1 in the local box.
    data = st.data[(None,) * st.prepend_axis_num]
    return LocalShard(st.key, tuple(st.global_shape), tuple(st.global_offset), data)


def _json_objects(objects: list) -> dict[str, Any]:
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    out = {}
    for obj in objects:
        if not is_main_replica(obj.replica_id):
            continue
        try:
            json.dumps(obj.data, allow_nan=False)
        except (TypeError, ValueError):
            log.warning("skipping ShardedObject %s: its %s data is not plain JSON and the "
                        "format stores no pickles", obj.unique_key, type(obj.data).__name__)
            continue
        out[obj.unique_key] = obj.data
    return out
