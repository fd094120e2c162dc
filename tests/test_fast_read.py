"""The fast read path (``checkpoint.fast_read``) against TensorStore's own reads.

Every case reads the same boxes twice, through ``fast_read`` and through TensorStore
(``read_boxes(..., fast=False)``), and compares bits; arrays are written by TensorStore
with ``format.array_spec``, so edge chunks, absent chunks and absent files are the
zarr v3 layout itself, not our idea of it.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts
import torch

from elastor_mcore import checkpoint as ck
from elastor_mcore.checkpoint import fast_read, reader
from elastor_mcore.checkpoint.format import Manifest, TensorEntry, array_spec
from elastor_mcore.checkpoint.store import numpy_view, shared_context
from elastor_mcore.geometry import Box

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

ENTRIES = {
    "even": TensorEntry((96, 64), "float32", (12, 16), (48, 32)),
    "edges": TensorEntry((37, 23), "float32", (8, 5), (16, 10)),  # partial edge chunks
    "cube": TensorEntry((9, 10, 7), "float32", (3, 4, 7), (6, 8, 7)),
    "vector": TensorEntry((50,), "float32", (8,), (24,)),
    "rows": TensorEntry((64, 24), "float32", (8, 24), (32, 24)),  # whole-row chunks: direct
    "unchecked": TensorEntry((40, 12), "float32", (8, 4), (16, 12), checksum="none"),
}


def write_array(step_dir: Path, key: str, entry: TensorEntry, seed: int) -> torch.Tensor:
    """Random values with zero blocks (stored like any other chunk: format version 2)."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(entry.shape, generator=g).to(DTYPES[entry.dtype])
    zero = [slice(0, max(1, n // 3)) for n in entry.shape]
    full[tuple(zero)] = 0
    arr = ts.open(array_spec(step_dir, key, entry), create=True,
                  context=shared_context()).result()
    arr[...] = numpy_view(full)
    return full


def both_ways(step_dir: Path, manifest: Manifest, targets: list[ck.LocalShard]) -> None:
    """Read ``targets`` fast, read clones through TensorStore, compare bits."""
    slow = [ck.LocalShard(t.key, t.global_shape, t.global_offset, torch.full_like(t.data, 7))
            for t in targets]
    before = fast_read.bytes_read()
    reader.read_boxes(step_dir, manifest, targets)
    assert fast_read.bytes_read() > before or all(t.data.numel() == 0 for t in targets)
    reader.read_boxes(step_dir, manifest, slow, fast=False)
    for t, s in zip(targets, slow):
        assert torch.equal(bits(t.data), bits(s.data)), (t.key, t.box)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view({2: torch.int16, 4: torch.int32}[tensor.element_size()])


def random_box(rng: random.Random, shape: tuple[int, ...]) -> Box:
    lo = [rng.randrange(n) for n in shape]
    return Box(tuple(lo), tuple(rng.randint(1, n - o) for o, n in zip(lo, shape)))


def strided(shape: tuple[int, ...], dtype: torch.dtype, kind: str) -> torch.Tensor:
    """A destination of ``shape``: contiguous, a transposed buffer's view, or every
    other element of a larger one."""
    if kind == "contiguous" or len(shape) == 1 and kind == "transposed":
        return torch.full(shape, 5, dtype=dtype)
    if kind == "transposed":
        return torch.full(shape[::-1], 5, dtype=dtype).permute(*reversed(range(len(shape))))
    big = torch.full(tuple(2 * n for n in shape), 5, dtype=dtype)
    return big[tuple(slice(None, None, 2) for _ in shape)]


@pytest.mark.parametrize("read_bytes", ["default", "one chunk"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_random_boxes_match_tensorstore(tmp_path, monkeypatch, name, dtype, seed, read_bytes):
    entry = dataclasses.replace(ENTRIES[name], dtype=dtype)
    if read_bytes == "one chunk":  # every run of adjacent chunks split into many reads
        monkeypatch.setattr(fast_read, "READ_BYTES", 1)
    full = write_array(tmp_path, "x", entry, seed)
    manifest = Manifest(step=1, tensors={"x": entry})
    rng = random.Random(seed)
    kinds = ["contiguous", "transposed", "every-other"]
    targets = [ck.LocalShard("x", entry.shape, (0,) * len(entry.shape),
                             strided(entry.shape, DTYPES[dtype], "contiguous"))]
    for i in range(12):
        box = random_box(rng, entry.shape)
        targets.append(ck.LocalShard("x", entry.shape, box.offset,
                                     strided(box.shape, DTYPES[dtype], kinds[i % 3])))
    both_ways(tmp_path, manifest, targets)
    assert torch.equal(targets[0].data, full)


def write_version_1(step_dir: Path, entry: TensorEntry) -> torch.Tensor:
    """An array as format version 1 stored it: TensorStore leaving chunks of zeros
    unwritten, here a whole file (0, 0) and one chunk of file (1, 1)."""
    full = torch.randn(entry.shape)
    full[:48, :32] = 0
    full[48:60, 32:48] = 0
    spec = array_spec(step_dir, "x", entry)
    spec["store_data_equal_to_fill_value"] = False
    ts.open(spec, create=True).result()[...] = full.numpy()
    assert not (step_dir / "x" / "c" / "0" / "0").exists()
    return full


def index_of(path: Path, chunks: int) -> np.ndarray:
    return np.frombuffer(path.read_bytes()[-(16 * chunks + 4):-4], "<u8").reshape(chunks, 2)


def test_version_1_absent_chunks_and_files_read_as_fill_value(tmp_path):
    entry = ENTRIES["even"]
    full = write_version_1(tmp_path, entry)
    index = index_of(tmp_path / "x" / "c" / "1" / "1", 8)
    assert index[0, 0] == fast_read.ABSENT and (index[1:] != fast_read.ABSENT).all()
    out = ck.LocalShard("x", entry.shape, (0, 0), torch.full(entry.shape, 3.0))
    both_ways(tmp_path, Manifest(step=1, tensors={"x": entry}, format_version=1), [out])
    assert torch.equal(out.data, full)


def test_version_2_stores_chunks_of_zeros(tmp_path):
    entry = ENTRIES["even"]
    full = write_array(tmp_path, "x", entry, seed=4)
    assert (full[:32, :21] == 0).all()  # the zero block spans whole chunks of file (0, 0)
    for path in (tmp_path / "x" / "c").glob("*/*"):
        assert (index_of(path, 8) != fast_read.ABSENT).all(), path


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "tensorstore"])
@pytest.mark.parametrize("damage", ["file", "chunk"])
def test_version_2_missing_file_or_chunk_is_damage(tmp_path, fast, damage):
    """A step of version 2 stores every chunk, so what is missing was lost: the read
    fails naming the tensor and file, on both read paths, instead of reading zeros."""
    entry = ENTRIES["even"]
    if damage == "file":
        write_array(tmp_path, "x", entry, seed=7)
        path = tmp_path / "x" / "c" / "1" / "0"
        path.unlink()
    else:  # a chunk absent from its file's index
        write_version_1(tmp_path, entry)
        path = tmp_path / "x" / "c" / "1" / "1"
    target = ck.LocalShard("x", entry.shape, (48, 0), torch.empty(48, 64))  # files (1, *)
    with pytest.raises(ck.CheckpointError, match=rf"tensor x: .*{path}.*(damaged|corrupted)"):
        reader.read_boxes(tmp_path, Manifest(step=1, tensors={"x": entry}), [target], fast=fast)


def test_saved_checkpoint_loads_through_fast_path(tmp_path):
    """A strided target and an overlapping parameter (its overlap filled by a copy)."""
    full = torch.randn(192, 64).to(torch.bfloat16)
    ck.save(tmp_path, 1, [ck.LocalShard("w", (192, 64), (lo, 0), full[lo:lo + 48].clone())
                          for lo in range(0, 192, 48)])
    before_fast, before_all = fast_read.bytes_read(), ck.storage_bytes_read()
    out = torch.empty(64, 192, dtype=torch.bfloat16).t()[:, 16:48]  # strided columns
    param = torch.nn.Parameter(torch.empty(100, 64, dtype=torch.bfloat16))  # overlaps out
    ck.load(tmp_path, [ck.LocalShard("w", (192, 64), (0, 16), out),
                       ck.LocalShard("w", (192, 64), (50, 0), param)])
    assert torch.equal(out, full[:, 16:48]) and torch.equal(param.detach(), full[50:150])
    assert fast_read.bytes_read() - before_fast == ck.storage_bytes_read() - before_all > 0


@pytest.mark.parametrize("where", ["chunk", "index"])
def test_corruption_names_tensor_and_file(tmp_path, where):
    entry = ENTRIES["even"]
    write_array(tmp_path, "x", entry, seed=5)
    path = tmp_path / "x" / "c" / "1" / "1"
    raw = bytearray(path.read_bytes())
    raw[-10 if where == "index" else 100] ^= 0xFF
    path.write_bytes(bytes(raw))
    target = ck.LocalShard("x", entry.shape, (0, 0), torch.empty(entry.shape))
    with pytest.raises(ck.CheckpointError,
                       match=rf"tensor x: checksum mismatch of .*{where}.* in file "
                             rf"{path}: the file is corrupted"):
        reader.read_boxes(tmp_path, Manifest(step=1, tensors={"x": entry}), [target])


def test_truncated_file_names_tensor_and_file(tmp_path):
    entry = ENTRIES["even"]
    write_array(tmp_path, "x", entry, seed=6)
    path = tmp_path / "x" / "c" / "1" / "0"
    path.write_bytes(path.read_bytes()[200:])
    target = ck.LocalShard("x", entry.shape, (0, 0), torch.empty(entry.shape))
    with pytest.raises(ck.CheckpointError, match=rf"tensor x: .* in file {path}"):
        reader.read_boxes(tmp_path, Manifest(step=1, tensors={"x": entry}), [target])


def test_other_layouts_fall_back_to_tensorstore(tmp_path):
    """A 0-d tensor, and a file grid the index math does not cover, go to TensorStore."""
    scalar = TensorEntry((), "float32", (), ())
    assert not fast_read.handles(scalar, ck.LocalShard("s", (), (), torch.empty(())))
    ragged = TensorEntry((12,), "float32", (4,), (6,))
    assert not fast_read.handles(ragged, ck.LocalShard("r", (12,), (0,), torch.empty(12)))
