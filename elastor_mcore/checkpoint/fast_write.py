"""Fast write path for elastor's own files: each file written whole, chunks checked in place.

TensorStore's zarr encode costs about 2.9 CPU-s per GB on a save (its crc32c and the
copies through its intermediate buffers), against 1.2 for a raw write of the same
bytes (docs/benchmarks.md). A save's write units are whole files (outer chunks), and
the files ``format.array_spec`` describes are simple (see ``fast_read``): so each
unit is written here as one file, its inner chunks in C order, each followed by its
crc32c, then the index of ``(offset, nbytes)`` pairs and the index's crc32c. A chunk
that is contiguous in the source goes to ``writev`` as it is, checksummed where it
lies; any other chunk, and an edge chunk (padded with the fill value, zeros), is
first copied into its own buffer. Inner chunks wholly outside the array are left
absent (``2**64 - 1`` in the index), as TensorStore leaves them. Every file is
fsynced; the commit fsyncs the directories.

Only local files with the ``bytes`` [+ ``crc32c``] codecs are written here; the
writer sends everything else (object storage, units that are not one whole file) to
TensorStore. ``tests/test_fast_write.py`` reads the files back through TensorStore.
"""

from __future__ import annotations

import itertools
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from elastor_mcore.checkpoint import fast_read
from elastor_mcore.checkpoint.fast_read import ABSENT, CRC_BYTES, MAX_IOVECS, READ_THREADS
from elastor_mcore.compat.crc32c import available as crc32c_available, crc32c
from elastor_mcore.checkpoint.format import (
    DTYPE_ITEMSIZE, CheckpointError, TensorEntry, failed_for, file_path)
from elastor_mcore.geometry import Box

WRITE_THREADS = READ_THREADS
"""Files written concurrently per process (the copies and checksums release the GIL)."""

FLUSH_BYTES = 8 << 20
"""Bytes gathered (chunk views and copies) before one ``writev``: bounds the copies."""


def handles(entry: TensorEntry, box: Box, data: torch.Tensor) -> bool:
    """Whether the unit ``box`` of a tensor stored as ``entry`` is one whole file that
    can be written here from ``data``."""
    return (crc32c_available() and data.device.type == "cpu"
            and len(entry.shape) > 0 and entry.dtype in DTYPE_ITEMSIZE
            and all(s % c == 0 for s, c in zip(entry.shard, entry.chunks))
            and all(o % s == 0 and n == min(s, total - o)
                    for o, n, s, total in zip(box.offset, box.shape, entry.shard, entry.shape)))


def write_files(step_dir: Path, units: Sequence[tuple[str, TensorEntry, Box, torch.Tensor]]) -> None:
    """Write each ``(key, entry, box, data)`` unit as its file under ``step_dir``."""
    if not units:
        return
    with ThreadPoolExecutor(max_workers=min(WRITE_THREADS, len(units))) as pool:
        failures = [f for f in pool.map(lambda unit: _write_safely(step_dir, *unit), units) if f]
    if failures:
        raise CheckpointError(f"write to {step_dir} failed for " + failed_for(failures))


def unit_path(step_dir: Path, key: str, entry: TensorEntry, box: Box) -> Path:
    """The file holding the outer chunk that begins at ``box.offset``."""
    return file_path(step_dir, key, [o // s for o, s in zip(box.offset, entry.shard)])


def _write_safely(step_dir: Path, key: str, entry: TensorEntry, box: Box,
                  data: torch.Tensor) -> str | None:
    """None, or the error naming the tensor and file (collected: all are reported)."""
    try:
        _write_file(step_dir, key, entry, box, data)
    except OSError as exc:
        return f"tensor {key}, file {unit_path(step_dir, key, entry, box)}: {exc}"
    return None


def _write_file(step_dir: Path, key: str, entry: TensorEntry, box: Box,
                data: torch.Tensor) -> None:
    source = fast_read.int_view(data)
    checked = entry.checksum == "crc32c"
    chunk_nbytes = math.prod(entry.chunks) * DTYPE_ITEMSIZE[entry.dtype]
    per_file = [s // c for s, c in zip(entry.shard, entry.chunks)]
    index = np.full((math.prod(per_file), 2), ABSENT, dtype="<u8")
    path = unit_path(step_dir, key, entry, box)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        pending: list[np.ndarray] = []
        pending_bytes, offset = 0, 0
        for i, position in enumerate(itertools.product(*(range(p) for p in per_file))):
            starts = [p * c for p, c in zip(position, entry.chunks)]
            if any(s >= n for s, n in zip(starts, box.shape)):
                continue  # wholly outside the array: absent
            part = source[tuple(slice(s, s + c) for s, c in zip(starts, entry.chunks))]
            whole = part.shape == tuple(entry.chunks)
            if whole and part.flags.c_contiguous:
                chunk = part
            elif whole:
                chunk = np.ascontiguousarray(part)
            else:  # an edge chunk: padded with the fill value
                chunk = np.zeros(entry.chunks, dtype=source.dtype)
                chunk[tuple(slice(0, n) for n in part.shape)] = part
            pending.append(chunk)
            if checked:
                pending.append(_crc_bytes(chunk.ctypes.data, chunk_nbytes))
            stored = chunk_nbytes + (CRC_BYTES if checked else 0)
            index[i] = (offset, stored)
            offset += stored
            pending_bytes += stored
            if pending_bytes >= FLUSH_BYTES or len(pending) >= MAX_IOVECS:
                _write_all(fd, pending)
                pending, pending_bytes = [], 0
        raw_index = np.ascontiguousarray(index)
        pending.append(raw_index)
        if checked:
            pending.append(_crc_bytes(raw_index.ctypes.data, raw_index.nbytes))
        _write_all(fd, pending)
        os.fsync(fd)
    finally:
        os.close(fd)


def _crc_bytes(address: int, nbytes: int) -> np.ndarray:
    return np.array([crc32c(address, nbytes)], dtype="<u4")


def _write_all(fd: int, buffers: list[np.ndarray]) -> None:
    """``writev`` until every byte of ``buffers`` is written (a call may write fewer)."""
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        written = os.writev(fd, views)
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]
