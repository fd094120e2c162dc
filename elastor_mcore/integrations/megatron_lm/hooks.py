"""Install Elastor into a Megatron-Core process: Elastor's parallel state in place of
``parallel_state.initialize_model_parallel``, and the zarr format behind
``dist_checkpointing.save/load``.

Everything is done by replacing module attributes, because Megatron-LM looks them up
at call time (``mpu.initialize_model_parallel(...)``, ``dist_checkpointing.save(...)``).
Names other modules imported by value are replaced there too:
``serialization.load_common_state_dict`` (used by ``load_content_metadata``) and
``get_default_load_sharded_strategy`` (imported by ``megatron.training.checkpointing``
at core_v0.16.1, which would fail on the unknown backend of a zarr checkpoint). At
core_v0.19.0 ``checkpointing.py`` builds ``TorchDistLoadShardedStrategy`` itself and
hands it to ``dist_checkpointing.load``; the patched ``load`` looks at the checkpoint's
marker before any strategy is used, so zarr loads go through it on both releases.
Under a layout, Megatron-LM's ``_build_sharded_state_dict_metadata`` also asks for per-layer keys.

Loads dispatch on the checkpoint's ``metadata.json`` marker, so torch_dist checkpoints
keep loading while saves go to zarr. Options may be given directly (tests, custom
scripts) or as a provider called on first use (Megatron-LM parses its arguments only
inside ``pretrain``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from elastor_mcore.checkpoint import megatron_dir
from elastor_mcore.parallel.groups import GroupCache, RankGroups, build_groups, install as install_groups
from elastor_mcore.parallel.layout import Layout
from elastor_mcore.checkpoint.megatron_dir import ZarrSaveSettings

log = logging.getLogger(__name__)

CKPT_FORMATS = ("zarr",)


@dataclass(frozen=True)
class ElastorOptions:
    """What the hooks do in this process."""

    layout: Layout | None = None
    """Build this layout's groups instead of Megatron's uniform grid (None: Megatron's)."""
    ckpt_format: str | None = None
    """``"zarr"`` saves in the elastor format; None leaves saving to Megatron-Core."""
    save: ZarrSaveSettings = field(default_factory=ZarrSaveSettings)

    def __post_init__(self) -> None:
        if self.ckpt_format not in (None, *CKPT_FORMATS):
            raise ValueError(f"ckpt_format={self.ckpt_format!r}: use one of {CKPT_FORMATS} "
                             f"or None")


@dataclass
class _Installed:
    provider: Callable[[], ElastorOptions]
    on_parallel_state: Callable[[RankGroups | None], None] | None
    originals: list[tuple[Any, str, Any]]
    options: ElastorOptions | None = None
    groups: RankGroups | None = None
    pg_collection: Any = None


_installed: _Installed | None = None


class ZarrLoadStrategy:
    """Stands for "read the elastor zarr format" where Megatron-LM builds a load
    strategy (it may wrap it, e.g. in ``FullyParallelLoadStrategyWrapper``); the
    patched ``load`` reads zarr checkpoints itself and never calls it."""

    backend = megatron_dir.BACKEND
    version = megatron_dir.BACKEND_VERSION
    can_handle_sharded_objects = True


def install(options: ElastorOptions | Callable[[], ElastorOptions],
            on_parallel_state: Callable[[RankGroups | None], None] | None = None) -> None:
    """Patch Megatron-Core (and ``megatron.training`` when importable); idempotent per
    process: a second call replaces the options. ``on_parallel_state`` runs after the
    layout's groups are installed (Megatron-LM uses it to adapt its arguments)."""
    global _installed
    provider = options if callable(options) else (lambda: options)
    if _installed is not None:
        _installed.provider, _installed.options = provider, None
        _installed.on_parallel_state = on_parallel_state
        return
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing import serialization

    originals: list[tuple[Any, str, Any]] = []

    def patch(module, name: str, make: Callable[[Any], Any]) -> None:
        if hasattr(module, name):
            original = getattr(module, name)
            originals.append((module, name, original))
            setattr(module, name, make(original))

    patch(parallel_state, "initialize_model_parallel", _wrap_initialize)
    for module in (dist_checkpointing, serialization):
        patch(module, "save", _wrap_save)
        patch(module, "load", _wrap_load)
        patch(module, "load_common_state_dict", _wrap_load_common)
    patch(serialization, "get_default_load_sharded_strategy", _wrap_load_strategy)
    try:
        from megatron.training import checkpointing as training_ckpt
    except ImportError:
        log.debug("megatron.training is not importable; patched Megatron-Core only")
    else:
        patch(training_ckpt, "get_default_load_sharded_strategy", _wrap_load_strategy)
        patch(training_ckpt, "_build_sharded_state_dict_metadata", _wrap_sd_metadata)
        from elastor_mcore.integrations.megatron_lm import object_storage  # s3:// --save
        object_storage.install(patch, training_ckpt)
        from elastor_mcore.integrations.megatron_lm import training  # heterogeneous loop
        training.install(patch, rank_groups, lambda: options().layout)
    _installed = _Installed(provider, on_parallel_state, originals)


def uninstall() -> None:
    """Restore every patched attribute (tests; a process normally keeps the hooks)."""
    global _installed
    if _installed is not None:
        for module, name, original in reversed(_installed.originals):
            setattr(module, name, original)
        _installed = None


def options() -> ElastorOptions:
    """The options in force (the provider is called once, on first use)."""
    if _installed is None:
        raise RuntimeError("elastor hooks are not installed; call hooks.install()")
    if _installed.options is None:
        _installed.options = _installed.provider()
    return _installed.options


def rank_groups() -> RankGroups | None:
    """This rank's groups from the installed layout (None: idle, or no layout)."""
    return _installed.groups if _installed else None


def pg_collection():
    """The ``ProcessGroupCollection`` of this rank under the installed layout."""
    return _installed.pg_collection if _installed else None


def initialize_parallel_state(layout: Layout, cache: GroupCache | None = None):
    """Build ``layout``'s groups (collective over the world) and install this rank's
    into ``parallel_state``; returns (groups, pg_collection), (None, None) if idle."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    groups = build_groups(layout, cache or GroupCache())
    pg = install_groups(groups) if groups is not None else None
    if _installed is not None:
        _installed.groups, _installed.pg_collection = groups, pg
    log.info("rank installed for layout %s", layout.describe())
    return groups, pg


# ----------------------------------------------------------------- replacement functions


def _wrap_initialize(original):
    def initialize_model_parallel(*args, **kwargs):
        layout = options().layout
        if layout is None:
            return original(*args, **kwargs)
        groups, _ = initialize_parallel_state(layout)
        if _installed.on_parallel_state is not None:
            _installed.on_parallel_state(groups)
        return None
    return initialize_model_parallel


def _wrap_save(original):
    def save(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        if options().ckpt_format != "zarr":
            return original(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        content_metadata = kwargs.get("content_metadata")
        if kwargs.get("async_sharded_save"):
            return megatron_dir.async_save(sharded_state_dict, checkpoint_dir,
                                            options().save, content_metadata=content_metadata)
        megatron_dir.save(sharded_state_dict, checkpoint_dir, options().save,
                           content_metadata=content_metadata)
        return None
    return save


def _wrap_load(original):
    def load(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        if not megatron_dir.is_zarr_checkpoint(checkpoint_dir):
            return original(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        from megatron.core.dist_checkpointing.validation import (
            StrictHandling, parse_strict_flag)

        strict = kwargs.get("strict", args[3] if len(args) > 3 else
                            StrictHandling.ASSUME_OK_UNEXPECTED)
        state = megatron_dir.load(sharded_state_dict, checkpoint_dir)
        if StrictHandling.requires_returning_mismatch_keys(parse_strict_flag(strict)):
            return state, set(), set()
        return state
    return load


def _wrap_load_common(original):
    def load_common_state_dict(checkpoint_dir):
        if megatron_dir.is_zarr_checkpoint(checkpoint_dir):
            return megatron_dir.load_common_state_dict(checkpoint_dir)
        return original(checkpoint_dir)
    return load_common_state_dict


def _wrap_load_strategy(original):
    def get_default_load_sharded_strategy(checkpoint_dir, *args, **kwargs):
        if megatron_dir.is_zarr_checkpoint(checkpoint_dir):
            return ZarrLoadStrategy()
        return original(checkpoint_dir, *args, **kwargs)
    return get_default_load_sharded_strategy


def _wrap_sd_metadata(original):
    """Per-layer keys whenever a layout is installed: with stacked layer keys a
    heterogeneous layout's shards of one key overlap inconsistently."""
    def build_metadata(*args, **kwargs):
        metadata = original(*args, **kwargs)
        if options().layout is not None:
            metadata["singleton_local_shards"] = True
        return metadata
    return build_metadata

