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
from typing import Callable, Sequence

import numpy as np
import torch

from elastor_mcore.checkpoint.format import DTYPE_ITEMSIZE, CheckpointError, TensorEntry
from elastor_mcore.checkpoint.plan import LocalShard
from elastor_mcore.geometry import Box

log = logging.getLogger(__name__)

READ_THREADS = 4
"""Files read concurrently per process: enough I/O depth for cold reads; the reads
release the GIL, so warm reads use the cores the rank has."""

ABSENT = 2**64 - 1
"""Index entry of a chunk that was never written: it reads as the fill value."""

CRC_BYTES = 4
MAX_IOVECS = 512
"""Buffers per ``preadv`` (two per chunk in a run); well under Linux's IOV_MAX."""

_bytes_read = 0
_bytes_lock = threading.Lock()


def _load_crc32c() -> Callable[[int, int, int], int] | None:
    """``crc32c_extend(crc, address, length)`` of the C library under ``google-crc32c``,
    called through ctypes: the package's own ``value`` accepts only ``bytes`` (a copy)
    and holds the GIL, while a ctypes call reads the tensor's memory and releases it."""
    try:
        import google_crc32c
        from google_crc32c import _crc32c  # type: ignore[attr-defined]
    except ImportError:
        log.warning("google-crc32c has no C extension here; checkpoint loads use "
                    "TensorStore (slower)")
        return None
    extend = ctypes.CDLL(_crc32c.__file__).crc32c_extend
    extend.restype = ctypes.c_uint32
    extend.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
    if extend(0, ctypes.cast(ctypes.c_char_p(b"123456789"), ctypes.c_void_p).value,
              9) != google_crc32c.value(b"123456789"):
        log.warning("google-crc32c's C library disagrees with its module; checkpoint "
                    "loads use TensorStore")
        return None
    return extend


_crc32c = _load_crc32c()


def bytes_read() -> int:
    """Bytes this process has read from checkpoint files through this path so far."""
    return _bytes_read


def handles(entry: TensorEntry, target: LocalShard) -> bool:
    """Whether ``target`` of a tensor stored as ``entry`` can be read here."""
    return (_crc32c is not None and target.data.device.type == "cpu"
            and len(entry.shape) > 0 and entry.dtype in DTYPE_ITEMSIZE
            and all(s % c == 0 for s, c in zip(entry.shard, entry.chunks)))


@dataclass(frozen=True)
class _FileRead:
    """The chunks of one file that one target needs."""

    entry: TensorEntry
    target: LocalShard
    path: Path
    chunks: list[tuple[int, ...]]
    """Grid coordinates of the inner chunks, in the order of the file's index."""


def read_targets(step_dir: Path, entries: dict[str, TensorEntry],
                 targets: Sequence[LocalShard]) -> None:
    """Fill every target's ``data`` with its box of the stored tensor.

    Raises one ``CheckpointError`` naming every failing tensor and file.
    """
    reads = [r for t in targets for r in _file_reads(step_dir, entries[t.key], t)]
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
            f"read from {step_dir} failed for " + "; ".join(failures[:5])
            + (f"; and {len(failures) - 5} more" if len(failures) > 5 else "")
            + ("; load another step" if corrupt else ""))


def _file_reads(step_dir: Path, entry: TensorEntry, target: LocalShard) -> list[_FileRead]:
    box, chunks, shard = target.box, entry.chunks, entry.shard
    ranges = [range(lo // c, -(-(lo + n) // c)) for lo, n, c in zip(box.offset, box.shape, chunks)]
    by_file: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for grid in itertools.product(*ranges):  # C order, so each file's list is too
        by_file.setdefault(tuple(g * c // s for g, c, s in zip(grid, chunks, shard)),
                           []).append(grid)
    base = step_dir / target.key / "c"
    return [_FileRead(entry, target, base.joinpath(*map(str, f)), grids)
            for f, grids in by_file.items()]


def _run_safely(read: _FileRead) -> int | str:
    """Bytes read, or the error message (collected, so every failure is reported)."""
    try:
        return _read_file(read)
    except (OSError, _Corrupt) as exc:
        return str(exc)


class _Corrupt(Exception):
    def __init__(self, path: Path, what: str) -> None:
        super().__init__(f"{what} in file {path}: the file is corrupted")


def _read_file(read: _FileRead) -> int:
    entry, target = read.entry, read.target
    box = target.box
    dest = _int_view(target.data)
    per_file = [s // c for s, c in zip(entry.shard, entry.chunks)]
    crc_bytes = CRC_BYTES if entry.checksum == "crc32c" else 0
    chunk_nbytes = math.prod(entry.chunks) * DTYPE_ITEMSIZE[entry.dtype]
    try:
        fd = os.open(read.path, os.O_RDONLY)
    except FileNotFoundError:  # no chunk of this file was written: all fill value
        for grid in read.chunks:
            dest[_slices(_chunk_box(grid, entry.chunks).intersect(box), box)] = 0
        return 0
    try:
        size = os.fstat(fd).st_size
        index = _read_index(fd, size, math.prod(per_file), crc_bytes, read.path)
        data_end = size - index.nbytes - crc_bytes
        direct: list[tuple[int, np.ndarray, tuple[int, ...]]] = []
        bounce: list[tuple[int, tuple[int, ...]]] = []
        for grid in read.chunks:
            offset, nbytes = (int(v) for v in index[np.ravel_multi_index(
                [g % p for g, p in zip(grid, per_file)], per_file)])
            chunk = _chunk_box(grid, entry.chunks)
            if offset == ABSENT and nbytes == ABSENT:
                dest[_slices(chunk.intersect(box), box)] = 0
                continue
            if nbytes != chunk_nbytes + crc_bytes or offset + nbytes > data_end:
                raise _Corrupt(read.path, f"index entry ({offset}, {nbytes}) of chunk {grid}")
            view = dest[_slices(chunk, box)] if box.contains(chunk) else None
            if view is not None and view.flags.c_contiguous:
                direct.append((offset, view, grid))
            else:
                bounce.append((offset, grid))
        done = _read_direct(fd, direct, chunk_nbytes, crc_bytes, read.path)
        done += _read_bounced(fd, bounce, read, dest, chunk_nbytes, crc_bytes)
        return done + index.nbytes + crc_bytes
    finally:
        os.close(fd)


def _read_index(fd: int, size: int, n: int, crc_bytes: int, path: Path) -> np.ndarray:
    length = 16 * n + crc_bytes
    if size < length:
        raise _Corrupt(path, f"{size} bytes, too short for an index of {n} chunks")
    raw = os.pread(fd, length, size - length)
    if len(raw) != length:
        raise _Corrupt(path, "short read of the index")
    if crc_bytes and _crc32c(0, _address(raw), 16 * n) != int.from_bytes(raw[-4:], "little"):
        raise _Corrupt(path, "checksum mismatch of the shard index")
    return np.frombuffer(raw, dtype="<u8", count=2 * n).reshape(n, 2)


def _read_direct(fd: int, chunks: list[tuple[int, np.ndarray, tuple[int, ...]]],
                 chunk_nbytes: int, crc_bytes: int, path: Path) -> int:
    """Chunks read straight into the target: runs adjacent in the file share one
    ``preadv``; each is checked where it landed, while still in cache."""
    chunks.sort(key=lambda c: c[0])
    stride = chunk_nbytes + crc_bytes
    total, start = 0, 0
    while start < len(chunks):
        end = start + 1
        while (end < len(chunks) and end - start < MAX_IOVECS // 2
               and chunks[end][0] == chunks[end - 1][0] + stride):
            end += 1
        run = chunks[start:end]
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
            for (_, view, grid), crc in zip(run, stored):
                if _crc32c(0, view.ctypes.data, chunk_nbytes) != crc:
                    raise _Corrupt(path, f"checksum mismatch of chunk {grid}")
        total += want
        start = end
    return total


def _read_bounced(fd: int, chunks: list[tuple[int, tuple[int, ...]]], read: _FileRead,
                  dest: np.ndarray, chunk_nbytes: int, crc_bytes: int) -> int:
    """Chunks only partly inside the target, or not contiguous there: read whole into
    a reused buffer, checked, then the needed part copied (by numpy: one thread, where
    torch's intra-op threads would spin on a loaded host)."""
    if not chunks:
        return 0
    entry, box = read.entry, read.target.box
    buf = np.empty(chunk_nbytes + crc_bytes, dtype=np.uint8)
    whole = buf[:chunk_nbytes].view(dest.dtype).reshape(entry.chunks)
    address = buf.ctypes.data
    for offset, grid in chunks:
        got = os.preadv(fd, [buf], offset)
        if got != buf.size:
            raise _Corrupt(read.path, f"short read ({got} of {buf.size} bytes)")
        if crc_bytes and _crc32c(0, address, chunk_nbytes) != int.from_bytes(
                buf[chunk_nbytes:].tobytes(), "little"):
            raise _Corrupt(read.path, f"checksum mismatch of chunk {grid}")
        chunk = _chunk_box(grid, entry.chunks)
        part = chunk.intersect(box)
        dest[_slices(part, box)] = whole[_slices(part, chunk)]
    return len(chunks) * buf.size


def _chunk_box(grid: tuple[int, ...], chunks: tuple[int, ...]) -> Box:
    return Box(tuple(g * c for g, c in zip(grid, chunks)), tuple(chunks))


def _slices(part: Box, within: Box) -> tuple[slice, ...]:
    """Index of the global box ``part`` in an array holding the global box ``within``."""
    return tuple(slice(lo - wo, lo - wo + n)
                 for lo, wo, n in zip(part.offset, within.offset, part.shape))


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _int_view(tensor: torch.Tensor) -> np.ndarray:
    """A numpy array of same-sized integers sharing ``tensor``'s memory and strides
    (numpy has no bfloat16, and bit copies need no float semantics)."""
    return tensor.detach().view(_INT_OF_SIZE[tensor.element_size()]).numpy()


def _address(raw: bytes) -> int:
    return ctypes.cast(ctypes.c_char_p(raw), ctypes.c_void_p).value
