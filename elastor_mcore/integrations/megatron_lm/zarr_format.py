"""Megatron-Core's ``dist_checkpointing`` on the elastor zarr format
(``--elastor-ckpt-format zarr``; ``checkpoint.megatron_dir`` reads and writes it).

Saves go to zarr when the option says so; loads dispatch on the checkpoint's
``metadata.json`` marker, so torch_dist checkpoints keep loading while saves go to zarr.
Besides ``save`` and ``load``, two names are replaced because Megatron looks at a
checkpoint through them before loading: ``load_common_state_dict`` (also behind
``load_content_metadata``) and ``get_default_load_sharded_strategy``, which would fail
on the unknown backend of a zarr checkpoint. ``hooks.PATCHES`` says where each goes.
"""

from __future__ import annotations

from typing import Callable

from elastor_mcore.checkpoint import megatron_dir
from elastor_mcore.checkpoint.plan import NO_REPLICAS, Replicas
from elastor_mcore.integrations.megatron_lm.installation import Installation
from elastor_mcore.parallel.layout import Layout
from elastor_mcore.parallel.shards import replica_classes
from elastor_mcore.runtime.distributed_optimizer import ZeroShards


class ZarrLoadStrategy:
    """Stands for "read the elastor zarr format" where Megatron-LM builds a load
    strategy (it may wrap it, e.g. in ``FullyParallelLoadStrategyWrapper``); the
    patched ``load`` reads zarr checkpoints itself and never calls it."""

    backend = megatron_dir.BACKEND
    version = megatron_dir.BACKEND_VERSION
    can_handle_sharded_objects = True


def state_replicas(layout: Layout | None, zero: ZeroShards | None,
                   distributed_optimizer: bool) -> Replicas:
    """Which ranks hold the same checkpointed tensors under ``layout``, so that the
    zarr saves and loads plan the distinct shards, not their copies (``Replicas``):
    each stage's data-parallel replicas hold the same model weights and, with
    Megatron's plain optimizer, the same optimizer state; under Elastor's ZeRO-1
    (``zero``) each rank's optimizer state is its own, saved and loaded on its file
    grid (``zero_optimizer.checkpoint_grid``). Megatron's own distributed optimizer
    (a uniform layout) shards its state over data parallelism on no such grid, and a
    run without a layout has none to derive the classes from: their tensors are
    planned per tensor (``NO_REPLICAS``)."""
    if layout is None or (distributed_optimizer and zero is None):
        return NO_REPLICAS
    if zero is None:
        return Replicas(replica_classes(layout))
    from elastor_mcore.integrations.megatron_lm.zero_optimizer import checkpoint_grid

    return Replicas(replica_classes(layout), grid=checkpoint_grid(zero))


def wrap_save(original: Callable, installation: Installation) -> Callable:
    def save(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        options = installation.options()
        if options.ckpt_format != "zarr":
            return original(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        content_metadata = kwargs.get("content_metadata")
        if kwargs.get("async_sharded_save"):
            return megatron_dir.async_save(sharded_state_dict, checkpoint_dir,
                                           options.save, content_metadata=content_metadata,
                                           replicas=installation.state_replicas)
        megatron_dir.save(sharded_state_dict, checkpoint_dir, options.save,
                          content_metadata=content_metadata,
                          replicas=installation.state_replicas)
        return None
    return save


def wrap_load(original: Callable, installation: Installation) -> Callable:
    def load(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        if not megatron_dir.is_zarr_checkpoint(checkpoint_dir):
            return original(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        from megatron.core.dist_checkpointing.validation import (
            StrictHandling, parse_strict_flag)

        strict = kwargs.get("strict", args[3] if len(args) > 3 else
                            StrictHandling.ASSUME_OK_UNEXPECTED)
        state = megatron_dir.load(sharded_state_dict, checkpoint_dir,
                                  replicas=installation.state_replicas)
        if StrictHandling.requires_returning_mismatch_keys(parse_strict_flag(strict)):
            return state, set(), set()
        return state
    return load


def wrap_load_common(original: Callable) -> Callable:
    def load_common_state_dict(checkpoint_dir):
        if megatron_dir.is_zarr_checkpoint(checkpoint_dir):
            return megatron_dir.load_common_state_dict(checkpoint_dir)
        return original(checkpoint_dir)
    return load_common_state_dict


def wrap_load_strategy(original: Callable) -> Callable:
    def get_default_load_sharded_strategy(checkpoint_dir, *args, **kwargs):
        if megatron_dir.is_zarr_checkpoint(checkpoint_dir):
            return ZarrLoadStrategy()
        return original(checkpoint_dir, *args, **kwargs)
    return get_default_load_sharded_strategy


def wrap_sharded_metadata(original: Callable, installation: Installation) -> Callable:
    """Per-layer keys whenever a layout is installed: with stacked layer keys a
    heterogeneous layout's shards of one key overlap inconsistently."""
    def build_metadata(*args, **kwargs):
        metadata = original(*args, **kwargs)
        if installation.layout is not None:
            metadata["singleton_local_shards"] = True
        return metadata
    return build_metadata
