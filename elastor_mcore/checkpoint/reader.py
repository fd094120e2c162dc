"""Load: range reads of exactly the boxes a rank needs, straight into its tensors.

A rank's reads are issued together as one TensorStore batch (so reads of one file are
coalesced) into the destination tensors' own memory, then awaited together. Only
committed steps are ever read.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import tensorstore as ts
import torch

from elastor_mcore.checkpoint import comm
from elastor_mcore.checkpoint.format import (
    CheckpointError, Manifest, TensorEntry, read_manifest, resolve_step_dir)
from elastor_mcore.checkpoint.plan import LocalShard
from elastor_mcore.checkpoint.store import numpy_view, open_arrays, wait_all
from elastor_mcore.geometry import Box

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorInfo:
    """One row of a checkpoint's tensor table."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    chunks: tuple[int, ...]
    files: int


class CheckpointReader:
    """Read-only access to one committed step, without any process group."""

    def __init__(self, step_dir: Path) -> None:
        self.path = step_dir
        self.manifest = read_manifest(step_dir)

    def tensors(self) -> list[TensorInfo]:
        return [TensorInfo(k, e.shape, e.dtype, e.nbytes, e.chunks, e.num_files)
                for k, e in sorted(self.manifest.tensors.items())]

    def read(self, key: str, box: Box | None = None) -> torch.Tensor:
        """The whole global tensor ``key``, or the part of it inside ``box``."""
        entry = _entry(self.manifest, key, self.path)
        box = box or Box((0,) * len(entry.shape), entry.shape)
        out = torch.empty(box.shape, dtype=getattr(torch, entry.dtype))
        read_boxes(self.path, self.manifest, [LocalShard(key, entry.shape, box.offset, out)])
        return out


def open_checkpoint(path: str | os.PathLike) -> CheckpointReader:
    """A reader for ``path``: a ``step_N`` directory, or a root (its latest step)."""
    return CheckpointReader(resolve_step_dir(path))


def load(path_or_root: str | os.PathLike, targets: Sequence[LocalShard],
         group=None) -> Manifest:
    """Fill every target's ``data`` in place with the checkpoint's bytes for its box.

    Called by every rank of ``group`` (default: the world). With a root directory,
    rank 0 of the group picks the step so all ranks read the same one.
    """
    error, step_dir = None, None
    if comm.is_coordinator(group):
        try:
            step_dir = str(resolve_step_dir(path_or_root))
        except CheckpointError as exc:
            error = exc
    comm.agree(error, f"checkpoint load from {path_or_root}", group)
    step_dir = Path(comm.all_gather(step_dir, group)[0])

    error, manifest = None, None
    try:
        manifest = read_manifest(step_dir)
        read_boxes(step_dir, manifest, targets)
    except CheckpointError as exc:
        error = exc
    comm.agree(error, f"checkpoint load from {step_dir}", group)
    log.info("loaded %d shards from %s", len(targets), step_dir)
    return manifest


def read_boxes(step_dir: Path, manifest: Manifest, targets: Sequence[LocalShard]) -> None:
    """Issue one batched read per target into its ``data``, then wait for all."""
    for target in targets:
        entry = _entry(manifest, target.key, step_dir)
        if tuple(target.global_shape) != entry.shape:
            raise CheckpointError(
                f"tensor {target.key}: the run expects global shape "
                f"{tuple(target.global_shape)}, {step_dir} has {entry.shape}; the model "
                f"config differs from the checkpoint's")
        if target.dtype != entry.dtype:
            raise CheckpointError(
                f"tensor {target.key}: the run holds {target.dtype}, {step_dir} stores "
                f"{entry.dtype}; load into a {entry.dtype} tensor and convert")
        target.validate()
    keys = {t.key for t in targets}
    arrays = open_arrays(step_dir, {k: manifest.tensors[k] for k in keys}, create=False)
    futures = []
    with ts.Batch() as batch:
        for target in targets:
            dest = ts.array(numpy_view(target.data), copy=False, write=True)
            source = arrays[target.key][target.box.slices()]
            futures.append((target.key, dest.write(source, batch=batch).commit))
    wait_all(futures, f"read from {step_dir}")


def _entry(manifest: Manifest, key: str, step_dir: Path) -> TensorEntry:
    try:
        return manifest.tensors[key]
    except KeyError:
        near = [k for k in manifest.tensors if k.split(".")[-1] == key.split(".")[-1]][:3]
        raise CheckpointError(
            f"tensor {key} is not in {step_dir} ({len(manifest.tensors)} tensors"
            + (f", e.g. {near}" if near else "") + "); the model or state naming differs "
            "from the checkpoint's") from None
