"""Write an elastor checkpoint from one process, one whole tensor at a time.

The collective writer (``checkpoint.write_checkpoint``) takes every shard at once;
a converter holds one tensor at a time instead. This module plans the arrays up
front from shapes alone, writes each tensor as it arrives, and commits through the
checkpoint writer's one-process steps (``begin_single``, ``write_whole``) and the
storage backend's commit (``Storage.commit_dir``), so the result is an ordinary
committed step (manifest last, atomic rename; on object storage the step is written
in place and its manifest commits it).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

import torch

from elastor_mcore.checkpoint import CheckpointError, ChunkPolicy, Manifest
from elastor_mcore.checkpoint.format import choose_entry
from elastor_mcore.checkpoint.storage import Location, as_path, storage_for
from elastor_mcore.checkpoint.writer import begin_single, write_whole

log = logging.getLogger(__name__)

Progress = Callable[[int, int, str], None]
"""``progress(done, total, name)``: called after each tensor a converter moves."""


class StreamingZarrWriter:
    """A checkpoint at ``path`` whose tensors (key -> (shape, dtype)) are declared
    up front and then written whole, one by one; ``commit`` makes it visible."""

    def __init__(self, path: str | os.PathLike, tensors: dict[str, tuple[tuple[int, ...], str]],
                 *, step: int = 0, manifest_extra: dict[str, Any] | None = None,
                 chunking: ChunkPolicy | None = None) -> None:
        self.path = as_path(path)
        if self.path.exists() and any(self.path.iterdir()):
            raise CheckpointError(f"{self.path} exists and is not empty; choose a new "
                                  f"directory")
        self.storage = storage_for(self.path)
        self.tmp = self.storage.staging_dir(self.path, "")
        self.step, self.manifest_extra = step, manifest_extra
        policy = chunking or ChunkPolicy()
        self.entries = {key: choose_entry(shape, dtype, [[0, n] for n in shape], policy)
                        for key, (shape, dtype) in tensors.items()}
        self.written: set[str] = set()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        Manifest.build(step, {}, 1, manifest_extra).to_json()  # fail before any write
        begin_single(self.tmp, self.entries)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        entry = self.entries.get(key)
        if entry is None:
            raise CheckpointError(f"tensor {key} was not declared for {self.path}")
        dtype = str(tensor.dtype).removeprefix("torch.")
        if tuple(tensor.shape) != entry.shape or dtype != entry.dtype:
            raise CheckpointError(
                f"tensor {key}: declared {entry.shape} {entry.dtype}, got "
                f"{tuple(tensor.shape)} {dtype}")
        write_whole(self.tmp, key, entry, tensor)
        self.written.add(key)

    def commit(self) -> Location:
        missing = sorted(set(self.entries) - self.written)
        if missing:
            raise CheckpointError(f"{self.path}: tensors {missing[:5]} were declared but "
                                  f"never written ({len(missing)} in all)")
        self.storage.commit_dir(self.tmp, self.path, Manifest.build(
            self.step, self.entries, 1, self.manifest_extra).to_json())
        log.info("committed %s (%d tensors)", self.path, len(self.entries))
        return self.path
