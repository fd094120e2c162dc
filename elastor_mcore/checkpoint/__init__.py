"""Partition-agnostic checkpoints: every global tensor stored once, in global shape,
as a zarr v3 array of small inner chunks; any layout loads it by range reads.

The layout-agnostic core is ``save`` / ``load`` on ``LocalShard`` lists;
``CheckpointManager`` runs a training run's saves (asynchronous by default); ``open`` reads
a checkpoint without a process group; ``adapter`` connects any mcore
``sharded_state_dict()``. The format is documented in ``docs/checkpoint-format.md``.
"""

from elastor_mcore.checkpoint.adapter import load_sharded_state_dict, save_sharded_state_dict
from elastor_mcore.checkpoint.format import (
    FORMAT_VERSION, CheckpointError, ChunkPolicy, Manifest, TensorEntry, check_compatible,
    committed_steps, latest_step)
from elastor_mcore.checkpoint.plan import LocalShard, WritePlan, WriteUnit, assign_writers
from elastor_mcore.checkpoint.manager import CheckpointManager, SavePolicy, SaveReport
from elastor_mcore.checkpoint.reader import CheckpointReader, TensorInfo, load
from elastor_mcore.checkpoint.reader import open_checkpoint as open
from elastor_mcore.checkpoint.store import storage_bytes_read
from elastor_mcore.checkpoint.writer import SaveResult, remove_stale, save, write_checkpoint

__all__ = [
    "FORMAT_VERSION", "CheckpointError", "CheckpointManager", "CheckpointReader",
    "ChunkPolicy", "LocalShard", "Manifest", "SavePolicy", "SaveReport", "SaveResult", "TensorEntry", "TensorInfo", "WritePlan", "WriteUnit",
    "assign_writers", "check_compatible", "committed_steps", "latest_step", "load",
    "load_sharded_state_dict", "open", "remove_stale", "save", "save_sharded_state_dict",
    "storage_bytes_read", "write_checkpoint",
]
