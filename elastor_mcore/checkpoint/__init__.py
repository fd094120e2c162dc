"""Partition-agnostic checkpoints: every global tensor stored once, in global shape,
as a zarr v3 array of small inner chunks; any layout loads it by range reads.

The layout-agnostic core is ``save`` / ``load`` on ``LocalShard`` lists;
``CheckpointManager`` runs a training run's saves (asynchronous by default); ``open`` reads
a checkpoint without a process group; ``adapter`` connects any mcore
``sharded_state_dict()``. The format is documented in ``docs/checkpoint-format.md``.
"""

import importlib
from typing import Any

_EXPORTS = {
    "adapter": ("load_sharded_state_dict", "save_sharded_state_dict"),
    "errors": ("CheckpointError",),
    "format": ("FORMAT_VERSION", "ChunkPolicy", "Manifest", "TensorEntry",
               "check_compatible", "committed_steps", "latest_step"),
    "plan": ("LocalShard", "Replicas", "WritePlan", "WriteUnit", "assign_writers"),
    "manager": ("CheckpointManager", "SavePolicy", "SaveReport"),
    "reader": ("CheckpointReader", "TensorInfo", "load", "open"),
    "store": ("storage_bytes_read",),
    "writer": ("SaveResult", "remove_stale", "save", "wait_for_pruning", "write_checkpoint"),
}
"""Public names by module. They are imported on first use: the format helpers
(``CheckpointError``, ``latest_step``) need neither torch nor TensorStore, so the
CLI and the supervisor can use them without paying for either."""
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
_RENAMED = {"open": "open_checkpoint"}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), _RENAMED.get(name, name))
    globals()[name] = value
    return value
