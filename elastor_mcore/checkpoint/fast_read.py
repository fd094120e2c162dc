"""Fast read path for elastor's own files: ``preadv`` of inner chunks into the targets.

TensorStore's zarr decode costs about 0.7 CPU-s per GB even warm (crc32c plus two
copies through intermediate buffers). The files ``format.array_spec`` describes are
simple enough to read directly: each file (outer chunk) ends with an index of
little-endian ``(offset, nbytes)`` uint64 pairs, one per inner chunk in C order,
followed by the index's crc32c; ``2**64 - 1`` marks an absent chunk (fill value);
each chunk is its raw little-endian bytes in the full chunk shape (edge chunks padded),
followed by their crc32c. A chunk that lies wholly inside a target and is contiguous
there is read straight into the target's memory and checked in place; any other chunk
goes through a small bounce buffer. Every chunk and index checksum is verified.

Only that layout is handled here (``bytes`` [+ ``crc32c``] codecs, local files, no
compression); ``reader.read_boxes`` sends everything else to TensorStore.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from elastor_mcore.checkpoint.format import (
    DTYPE_ITEMSIZE, CheckpointError, TensorEntry, failed_for, file_path)
from elastor_mcore.checkpoint.plan import LocalShard
from elastor_mcore.compat.crc32c import available as crc32c_available, crc32c

log = logging.getLogger(__name__)

READ_THREADS = 4
"""Files read concurrently per process: enough I/O depth for cold reads; the reads
release the GIL, so warm reads use the cores the rank has."""

ABSENT = 2**64 - 1
"""Index entry of a chunk that was never written: the fill value in a version-1 step,
damage in a newer one (``Manifest.every_chunk_stored``)."""

CRC_BYTES = 4
READ_BYTES = 256 * 1024
"""Bytes per ``preadv``, into a target or the bounce buffer: about one inner chunk, so
crc32c checks the bytes from the core's cache right after they land (in one thread,
warm: 0.28 CPU-s per GB, against 0.34 with runs of up to 64 MB checked afterwards)."""
MAX_IOVECS = 512
"""Buffers per ``preadv`` (two per chunk in a run); well under Linux's IOV_MAX."""

_bytes_read = 0
_bytes_lock = threading.Lock()


def bytes_read() -> int:
    """Bytes this process has read from checkpoint files through this path so far."""
    return _bytes_read


def handles(entry: TensorEntry, target: LocalShard) -> bool:
    """Whether ``target`` of a tensor stored as ``entry`` can be read here."""
    return (crc32c_available() and target.data.device.type == "cpu"
            and len(entry.shape) > 0 and entry.dtype in DTYPE_ITEMSIZE
            and all(s % c == 0 for s, c in zip(entry.shard, entry.chunks)))


@dataclass(frozen=True)
class _FileRead:
    """The chunks of one file that one target needs."""

    entry: TensorEntry
    target: LocalShard
    path: Path
    axes: list[list[_Axis]]
    """Per dimension, the file's inner chunks that meet the target, ascending: the
    chunks are their product, in the order of the file's index."""
    missing_is_damage: bool
    """A missing file or chunk fails the read (version 2) instead of reading zeros."""


@dataclass(frozen=True)
class _Axis:
    """One inner chunk's extent along one dimension, precomputed so the chunk loop
    does no geometry."""

    local: int
    """Its position along this dimension within its file."""
    dest: slice
    """Where its part lies in the target."""
    source: slice
    """Which of its elements lie in the target."""
    whole: bool
    """Whether all of it lies in the target."""


def read_targets(step_dir: Path, entries: dict[str, TensorEntry],
                 targets: Sequence[LocalShard], *, missing_is_damage: bool) -> None:
    """Fill every target's ``data`` with its box of the stored tensor.

    Raises one ``CheckpointError`` naming every failing tensor and file; with
    ``missing_is_damage`` a missing file or chunk is one (else it reads as zeros).
    """
    reads = [r for t in targets
             for r in _file_reads(step_dir, entries[t.key], t, missing_is_damage)]
    failures: list[str] = []
    total = 0
    with ThreadPoolExecutor(max_workers=min(READ_THREADS, max(1, len(reads)))) as pool:
        for read, outcome in zip(reads, pool.map(_run_safely, reads)):
            if isinstance(outcome, str):
                failures.append(f"tensor {read.target.key}: {outcome}")
            else:
                total += outcome
    global _bytes_read
    with _bytes_lock:
        _bytes_read += total
    if failures:
        corrupt = any("corrupted" in f for f in failures)
        raise CheckpointError(
            f"read from {step_dir} failed for " + failed_for(failures)
            + ("; load another step" if corrupt else ""))


def _file_reads(step_dir: Path, entry: TensorEntry, target: LocalShard,
                missing_is_damage: bool) -> list[_FileRead]:
    box = target.box
    per_dim = []  # per dimension: {file coordinate: [_Axis, ...]}
    for lo, n, c, s in zip(box.offset, box.shape, entry.chunks, entry.shard):
        files: dict[int, list[_Axis]] = {}
        for g in range(lo // c, -(-(lo + n) // c)):
            start, stop = max(g * c, lo), min(g * c + c, lo + n)
            files.setdefault(g * c // s, []).append(_Axis(
                g % (s // c), slice(start - lo, stop - lo), slice(start - g * c, stop - g * c),
                start == g * c and stop == g * c + c))
        per_dim.append(sorted(files.items()))
    return [_FileRead(entry, target, file_path(step_dir, target.key, [f for f, _ in combo]),
                      [axes for _, axes in combo], missing_is_damage)
            for combo in itertools.product(*per_dim)]


def _run_safely(read: _FileRead) -> int | str:
    """Bytes read, or the error message (collected, so every failure is reported)."""
    try:
        return _read_file(read)
    except (OSError, _Corrupt, _Missing) as exc:
        return str(exc)


class _Corrupt(Exception):
    def __init__(self, path: Path, what: str) -> None:
        super().__init__(f"{what} in file {path}: the file is corrupted")


class _Missing(Exception):
    def __init__(self, path: Path) -> None:
        super().__init__(f"file {path} is missing: the step is damaged (corrupted)")


def _read_file(read: _FileRead) -> int:
    entry = read.entry
    dest = int_view(read.target.data)
    per_file = [s // c for s, c in zip(entry.shard, entry.chunks)]
    crc_bytes = CRC_BYTES if entry.checksum == "crc32c" else 0
    chunk_nbytes = math.prod(entry.chunks) * DTYPE_ITEMSIZE[entry.dtype]
    chunks = list(itertools.product(*read.axes))
    try:
        fd = os.open(read.path, os.O_RDONLY)
    except FileNotFoundError:  # no chunk of this file was written
        if read.missing_is_damage:
            raise _Missing(read.path) from None
        for chunk in chunks:
            dest[tuple(a.dest for a in chunk)] = 0
        return 0
    try:
        size = os.fstat(fd).st_size
        index = _read_index(fd, size, math.prod(per_file), crc_bytes, read.path)
        data_end = size - index.nbytes - crc_bytes
        entries = index.tolist()
        strides = [math.prod(per_file[d + 1:]) for d in range(len(per_file))]
        direct: list[tuple[int, np.ndarray, tuple[_Axis, ...]]] = []
        bounce: list[tuple[int, tuple[_Axis, ...]]] = []
        for chunk in chunks:
            offset, nbytes = entries[sum(a.local * st for a, st in zip(chunk, strides))]
            if offset == ABSENT and nbytes == ABSENT:
                if read.missing_is_damage:
                    raise _Corrupt(read.path, f"chunk {_where(chunk)} absent from the index")
                dest[tuple(a.dest for a in chunk)] = 0
                continue
            if nbytes != chunk_nbytes + crc_bytes or offset + nbytes > data_end:
                raise _Corrupt(read.path, f"index entry ({offset}, {nbytes}) of chunk "
                                          f"{_where(chunk)}")
            view = dest[tuple(a.dest for a in chunk)] if all(a.whole for a in chunk) else None
            if view is not None and view.flags.c_contiguous:
                direct.append((offset, view, chunk))
            else:
                bounce.append((offset, chunk))
        done = _read_direct(fd, direct, chunk_nbytes, crc_bytes, read.path)
        done += _read_bounced(fd, bounce, read, dest, chunk_nbytes, crc_bytes)
        return done + index.nbytes + crc_bytes
    finally:
        os.close(fd)


def _where(chunk: tuple[_Axis, ...]) -> str:
    """A chunk named by its position in its file, for error messages."""
    return str(tuple(a.local for a in chunk))


def _read_index(fd: int, size: int, n: int, crc_bytes: int, path: Path) -> np.ndarray:
    length = 16 * n + crc_bytes
    if size < length:
        raise _Corrupt(path, f"{size} bytes, too short for an index of {n} chunks")
    raw = os.pread(fd, length, size - length)
    if len(raw) != length:
        raise _Corrupt(path, "short read of the index")
    if crc_bytes and crc32c(_address(raw), 16 * n) != int.from_bytes(raw[-4:], "little"):
        raise _Corrupt(path, "checksum mismatch of the shard index")
    return np.frombuffer(raw, dtype="<u8", count=2 * n).reshape(n, 2)


def _read_direct(fd: int, chunks: list[tuple[int, np.ndarray, tuple[_Axis, ...]]],
                 chunk_nbytes: int, crc_bytes: int, path: Path) -> int:
    """Chunks read straight into the target: runs adjacent in the file share one
    ``preadv`` of up to ``READ_BYTES``; each is checked where it landed, while still in
    cache."""
    stride = chunk_nbytes + crc_bytes
    total = 0
    for run in _runs(chunks, stride, max(1, min(MAX_IOVECS // 2, READ_BYTES // stride))):
        crcs = np.empty((len(run), crc_bytes), dtype=np.uint8)
        buffers: list[np.ndarray] = []
        for i, (_, view, _) in enumerate(run):
            buffers.append(view)
            if crc_bytes:
                buffers.append(crcs[i])
        want = stride * len(run)
        got = os.preadv(fd, buffers, run[0][0])
        if got != want:
            raise _Corrupt(path, f"short read ({got} of {want} bytes)")
        if crc_bytes:
            stored = crcs.view("<u4")[:, 0]
            for (_, view, chunk), crc in zip(run, stored):
                if crc32c(view.ctypes.data, chunk_nbytes) != crc:
                    raise _Corrupt(path, f"checksum mismatch of chunk {_where(chunk)}")
        total += want
    return total


def _read_bounced(fd: int, chunks: list[tuple[int, tuple[_Axis, ...]]], read: _FileRead,
                  dest: np.ndarray, chunk_nbytes: int, crc_bytes: int) -> int:
    """Chunks only partly inside the target, or not contiguous there: runs adjacent in
    the file are read into a reused buffer of about ``READ_BYTES`` (one ``preadv``),
    each chunk checked, then its needed part copied (by numpy: one thread, where
    torch's intra-op threads would spin on a loaded host)."""
    if not chunks:
        return 0
    entry = read.entry
    stride = chunk_nbytes + crc_bytes
    per_read = max(1, min(len(chunks), READ_BYTES // stride))
    buf = np.empty(per_read * stride, dtype=np.uint8)
    raw, address = memoryview(buf), buf.ctypes.data
    wholes = [buf[i * stride:i * stride + chunk_nbytes].view(dest.dtype).reshape(entry.chunks)
              for i in range(per_read)]
    total = 0
    for run in _runs(chunks, stride, per_read):
        want = len(run) * stride
        got = os.preadv(fd, [raw[:want]], run[0][0])
        if got != want:
            raise _Corrupt(read.path, f"short read ({got} of {want} bytes)")
        for i, (_, chunk) in enumerate(run):
            at = i * stride
            if crc_bytes and crc32c(address + at, chunk_nbytes) != int.from_bytes(
                    raw[at + chunk_nbytes:at + stride], "little"):
                raise _Corrupt(read.path, f"checksum mismatch of chunk {_where(chunk)}")
            dest[tuple(a.dest for a in chunk)] = wholes[i][tuple(a.source for a in chunk)]
        total += want
    return total


def _runs(chunks: list, stride: int, most: int) -> Iterator[list]:
    """``chunks`` (tuples whose first item is the chunk's file offset) sorted by offset
    and cut into runs adjacent in the file, of at most ``most`` chunks: one ``preadv``
    each."""
    chunks.sort(key=lambda c: c[0])
    start = 0
    while start < len(chunks):
        end = start + 1
        while (end < len(chunks) and end - start < most
               and chunks[end][0] == chunks[end - 1][0] + stride):
            end += 1
        yield chunks[start:end]
        start = end


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def int_view(tensor: torch.Tensor) -> np.ndarray:
    """A numpy array of same-sized integers sharing ``tensor``'s memory and strides
    (numpy has no bfloat16, and bit copies need no float semantics)."""
    return tensor.detach().view(_INT_OF_SIZE[tensor.element_size()]).numpy()


def _address(raw: bytes) -> int:
    return ctypes.cast(ctypes.c_char_p(raw), ctypes.c_void_p).value
