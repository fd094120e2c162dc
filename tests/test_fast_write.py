"""The fast write path (``checkpoint.fast_write``) against TensorStore's own reads.

Arrays are written file by file through ``fast_write`` from sources of several
memory layouts, then read back by TensorStore (``read_boxes(..., fast=False)``, the
zarr v3 reader, independent of ours) whole and in random boxes, bit for bit; edge
chunks, chunks outside the array, bf16 and unchecked arrays included. Seeds are the
test parameters.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from pathlib import Path

import pytest
import torch

from elastor_mcore import checkpoint as ck
from elastor_mcore.checkpoint import fast_write, reader
from elastor_mcore.checkpoint.format import Manifest, TensorEntry
from elastor_mcore.geometry import Box, local_view
from tests.test_fast_read import DTYPES, ENTRIES, bits, random_box, strided


def file_boxes(entry: TensorEntry) -> list[Box]:
    """One box per file (outer chunk), truncated at the array's edge."""
    ranges = [range(0, n, s) for n, s in zip(entry.shape, entry.shard)]
    return [Box(lo, tuple(min(s, n - o) for o, s, n in zip(lo, entry.shard, entry.shape)))
            for lo in itertools.product(*ranges)]


def write_fast(step_dir: Path, entry: TensorEntry, source: torch.Tensor) -> None:
    whole = Box((0,) * len(entry.shape), entry.shape)
    units = [("x", entry, box, local_view(source, whole, box)) for box in file_boxes(entry)]
    assert all(fast_write.handles(entry, box, data) for _, _, box, data in units)
    fast_write.write_files(step_dir, units)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "every-other"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_files_read_back_through_tensorstore(tmp_path, name, dtype, layout, seed):
    entry = dataclasses.replace(ENTRIES[name], dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(entry.shape, generator=g).to(DTYPES[dtype])
    full[tuple(slice(0, max(1, n // 3)) for n in entry.shape)] = 0  # zero chunks too
    source = strided(entry.shape, DTYPES[dtype], layout)
    source.copy_(full)
    write_fast(tmp_path, entry, source)

    manifest = Manifest(step=1, tensors={"x": entry})
    rng = random.Random(seed)
    targets = [ck.LocalShard("x", entry.shape, (0,) * len(entry.shape),
                             torch.full(entry.shape, 7, dtype=DTYPES[dtype]))]
    for _ in range(8):
        box = random_box(rng, entry.shape)
        targets.append(ck.LocalShard("x", entry.shape, box.offset,
                                     torch.full(box.shape, 7, dtype=DTYPES[dtype])))
    reader.read_boxes(tmp_path, manifest, targets, fast=False)
    whole = Box((0,) * len(entry.shape), entry.shape)
    for t in targets:
        assert torch.equal(bits(t.data), bits(local_view(full, whole, t.box))), t.box


def test_saves_write_their_files_through_the_fast_path(tmp_path, monkeypatch):
    written = []
    real = fast_write.write_files
    monkeypatch.setattr(fast_write, "write_files",
                        lambda step_dir, units: written.extend(units) or real(step_dir, units))
    full = torch.randn(192, 64)
    ck.save(tmp_path, 1, [ck.LocalShard("w", (192, 64), (lo, 0), full[lo:lo + 48].clone())
                          for lo in range(0, 192, 48)])
    plan_units = ck.open(tmp_path).manifest.tensors["w"].num_files
    assert len(written) == plan_units > 0
    out = torch.empty(192, 64)
    reader.read_boxes(tmp_path / "step_00000001", ck.open(tmp_path).manifest,
                      [ck.LocalShard("w", (192, 64), (0, 0), out)], fast=False)
    assert torch.equal(out, full)


def test_write_error_names_the_tensor_and_file(tmp_path):
    entry = ENTRIES["even"]
    (tmp_path / "x").write_text("a file where the array's directory belongs")
    with pytest.raises(ck.CheckpointError, match=r"tensor x, file .*x/c/0/0"):
        write_fast(tmp_path, entry, torch.zeros(entry.shape))


def test_units_that_are_not_whole_files_go_to_tensorstore():
    entry = ENTRIES["even"]  # files of 48 x 32
    data = torch.zeros(24, 32)
    assert not fast_write.handles(entry, Box((0, 0), (24, 32)), data)   # half a file
    assert not fast_write.handles(entry, Box((24, 0), (48, 32)), torch.zeros(48, 32))
    assert fast_write.handles(entry, Box((48, 32), (48, 32)), torch.zeros(48, 32))
