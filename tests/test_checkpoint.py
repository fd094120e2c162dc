"""Checkpoint format, single process: resharding, writer plan, commit protocol, bad input.

Without a process group the library runs as a world of one; one "rank" may hold many
shards (TP-style quarters, replicas), which is enough to exercise the geometry.
"""

from __future__ import annotations

import gc
import json
import os
import zlib
from pathlib import Path

import pytest
import torch

from elastor_mcore import checkpoint as ck
from elastor_mcore.checkpoint import manager, reader, writer
from elastor_mcore.checkpoint.format import choose_entry
from elastor_mcore.checkpoint.plan import build_plan
from elastor_mcore.cli import main as cli_main
from elastor_mcore.geometry import Box, ShardInfo
from tests.checkpoint_checks import (
    MAX_READ_AMPLIFICATION, amplification, assert_balanced, assert_units_tile)

SHAPE = (192, 64)


def global_tensor(key: str, dtype: torch.dtype, shape=SHAPE) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.randn(shape, generator=g).to(dtype)


def rows(key: str, full: torch.Tensor, lo: int, hi: int) -> ck.LocalShard:
    return ck.LocalShard(key, tuple(full.shape), (lo, 0), full[lo:hi].clone())


def row_splits(n: int, bounds: list[int]) -> list[tuple[int, int]]:
    return list(zip(bounds[:-1], bounds[1:]))


def tp_splits(n: int, parts: int) -> list[tuple[int, int]]:
    return row_splits(n, [i * n // parts for i in range(parts + 1)])


def save_quarters(root: Path, dtype: torch.dtype, step: int = 1, **kw) -> torch.Tensor:
    """Save one tensor as TP=4 quarters, each held twice (replicas)."""
    full = global_tensor("w", dtype)
    shards = [rows("w", full, lo, hi) for lo, hi in tp_splits(SHAPE[0], 4) for _ in range(2)]
    ck.save(root, step, shards, {"model": {"hidden_size": 64}}, **kw)
    return full


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(ints),
                                              b.contiguous().view(ints))


# ------------------------------------------------------------------ resharding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bounds", [
    [0, 96, 192],          # TP=2
    [0, 50, 131, 192],     # 3-way, uneven
    [0, 192],              # whole
], ids=["halves", "uneven3", "whole"])
def test_resharded_load_is_bit_exact(tmp_path, dtype, bounds):
    full = save_quarters(tmp_path, dtype)
    targets = [ck.LocalShard("w", SHAPE, (lo, 0), torch.full((hi - lo, 64), -7.0, dtype=dtype))
               for lo, hi in row_splits(SHAPE[0], bounds)]
    manifest = ck.load(tmp_path, targets)
    assert manifest.step == 1
    for t in targets:
        assert same_bits(t.data, full[t.box.slices()])


def test_load_fills_non_contiguous_views(tmp_path):
    full = save_quarters(tmp_path, torch.float32)
    param = torch.zeros(64, 192)  # the target is a transposed view of a parameter
    ck.load(tmp_path, [ck.LocalShard("w", SHAPE, (0, 0), param.t())])
    assert same_bits(param.t(), full)


@pytest.mark.parametrize("save_parts,load_parts", [(4, 2), (2, 4)])
def test_read_amplification(tmp_path, save_parts, load_parts):
    """Resharding between valid TP sizes reads (almost) only the needed bytes."""
    full = global_tensor("w", torch.float32)
    ck.save(tmp_path, 1, [rows("w", full, lo, hi) for lo, hi in tp_splits(SHAPE[0], save_parts)])
    lo, hi = tp_splits(SHAPE[0], load_parts)[1]
    target = ck.LocalShard("w", SHAPE, (lo, 0), torch.empty(hi - lo, 64))
    before = ck.storage_bytes_read()
    ck.load(tmp_path, [target])
    ratio = amplification(ck.storage_bytes_read() - before, target.data.numel() * 4)
    assert ratio <= MAX_READ_AMPLIFICATION
    assert same_bits(target.data, full[lo:hi])


def test_open_reads_a_box_without_a_process_group(tmp_path):
    full = save_quarters(tmp_path, torch.bfloat16)
    reader = ck.open(tmp_path)
    assert reader.manifest.model == {"hidden_size": 64}
    [info] = reader.tensors()
    assert (info.name, info.shape, info.dtype, info.nbytes) == ("w", SHAPE, "bfloat16",
                                                                  192 * 64 * 2)
    assert same_bits(reader.read("w"), full)
    assert same_bits(reader.read("w", Box((10, 5), (30, 7))), full[10:40, 5:12])


# ------------------------------------------------------------------ format choices


def test_chunks_are_unions_for_every_tp_size():
    entry = choose_entry(SHAPE, "float32", [[0, 96, 192], [0, 64]], ck.ChunkPolicy())
    assert entry.chunks == (24, 64)  # 192 / lcm(1, 2, 4, 8); the unsplit dim stays whole
    for tp in (1, 2, 4, 8):
        assert (SHAPE[0] // tp) % entry.chunks[0] == 0
    assert entry.shard == (96, 64)  # no file straddles a saving rank's boundary
    big = choose_entry((8192, 4096), "bfloat16", [[0, 4096, 8192], [0, 4096]],
                       ck.ChunkPolicy())
    assert big.nbytes // big.num_chunks <= ck.ChunkPolicy().chunk_bytes
    assert (8192 // 8) % big.chunks[0] == 0
    # rows stay whole (contiguous in a row-sharded target), and the chunk is the largest
    # such one under the limit: 32 rows of 4096 bf16 are exactly 256 KiB
    assert big.chunks == (32, 4096)
    wide = choose_entry((768, 3072), "float32", [[0, 768], [0, 1536, 3072]],
                        ck.ChunkPolicy(split_sizes=(1, 2, 3, 4)))
    assert wide.chunks == (256, 256)  # split columns: 3072 / 12; then rows down to the limit


def test_writer_assignment_spreads_replicas():
    units = [ck.WriteUnit(f"t{i}", Box((0,), (n,)), holders, n)
             for i, (n, holders) in enumerate(
                 [(100, (0, 1, 2, 3))] * 8 + [(60, (0,)), (60, (1,)), (30, (2, 3)),
                                             (250, (0, 1)), (250, (2, 3))])]
    assigned = ck.assign_writers(units)
    assert assigned == ck.assign_writers(units)  # deterministic
    loads = {r: 0 for r in range(4)}
    for u in assigned:
        assert u.writer in u.holders
        loads[u.writer] += u.nbytes
    assert_balanced(loads)


def test_plan_writes_each_cell_once_and_balances():
    """TP=4 quarters held by two ranks each (rank r: quarters r, r+1): every element is
    in exactly one unit and the writing is spread over all four ranks."""
    quarters = tp_splits(512, 4)
    infos = {r: [ShardInfo("emb", (512, 64), Box((quarters[q][0], 0), (128, 64)), "bfloat16")
                 for q in (r, (r + 1) % 4)] for r in range(4)}
    plan = build_plan(infos, ck.ChunkPolicy(chunk_bytes=2048, file_bytes=4096))
    assert_units_tile([(u.key, u.box.offset, u.box.shape) for u in plan.units],
                      {"emb": (512, 64)})
    assert all(u.writer in u.holders for u in plan.units)
    assert_balanced(plan.bytes_by_rank())


# ------------------------------------------------------------------ commit protocol


def test_keep_last_k_and_latest(tmp_path):
    for step in (1, 2, 3, 4):
        save_quarters(tmp_path, torch.float32, step=step, keep=2)
    assert ck.committed_steps(tmp_path) == [3, 4]
    assert ck.latest_step(tmp_path) == 4
    assert (tmp_path / "latest").read_text().strip() == "step_00000004"
    assert ck.load(tmp_path, []).step == 4
    ck.wait_for_pruning()  # pruned steps are deleted in the background
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest", "step_00000003", "step_00000004"]


def test_saves_and_loads_run_with_the_cyclic_collector_paused(tmp_path, monkeypatch):
    """A full collection in a big training process took up to 0.8 s per rank mid-load."""
    enabled_inside = []

    def spy(module, name):
        inner = getattr(module, name)

        def call(*args, **kwargs):
            enabled_inside.append((name, gc.isenabled()))
            return inner(*args, **kwargs)
        monkeypatch.setattr(module, name, call)

    spy(writer, "write_share")  # synchronous saves
    spy(reader, "read_boxes")  # loads
    spy(manager.CheckpointManager, "_start")  # an asynchronous save's blocking part
    full = save_quarters(tmp_path / "sync", torch.float32)
    target = ck.LocalShard("w", SHAPE, (0, 0), torch.empty(SHAPE))
    ck.load(tmp_path / "sync", [target])
    saver = ck.CheckpointManager(tmp_path / "async")
    saver.save(1, [ck.LocalShard("w", SHAPE, (0, 0), full)])
    saver.close()
    assert enabled_inside == [("write_share", False), ("read_boxes", False),
                              ("_start", False)]
    assert gc.isenabled() and torch.equal(target.data, full)


def test_keep_must_be_positive(tmp_path):
    with pytest.raises(ck.CheckpointError, match="keep=0"):
        save_quarters(tmp_path, torch.float32, keep=0)


def test_failed_save_leaves_previous_step_and_is_cleaned(tmp_path, monkeypatch):
    save_quarters(tmp_path, torch.float32, step=1)

    def disk_full(*args):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(writer, "_write_units", disk_full)
        with pytest.raises(ck.CheckpointError, match="No space left"):
            save_quarters(tmp_path, torch.float32, step=2)
    assert (tmp_path / ".tmp_step_00000002").is_dir()
    assert ck.committed_steps(tmp_path) == [1] and ck.latest_step(tmp_path) == 1
    save_quarters(tmp_path, torch.float32, step=3)
    assert not any(p.name.startswith(".tmp_") for p in tmp_path.iterdir())


def test_uncommitted_step_is_never_loaded(tmp_path):
    full = save_quarters(tmp_path, torch.float32, step=1)
    partial = tmp_path / "step_00000009"
    partial.mkdir()
    (partial / "zarr.json").write_text("{}")
    (tmp_path / "latest").write_text("step_00000009\n")  # even if latest names it
    assert ck.latest_step(tmp_path) == 1
    target = ck.LocalShard("w", SHAPE, (0, 0), torch.empty(SHAPE))
    assert ck.load(tmp_path, [target]).step == 1 and same_bits(target.data, full)
    with pytest.raises(ck.CheckpointError, match="never committed"):
        ck.load(partial, [target])


# ------------------------------------------------------------------ bad input


def test_load_from_empty_directory(tmp_path):
    with pytest.raises(ck.CheckpointError, match="no committed checkpoint in"):
        ck.load(tmp_path, [])
    with pytest.raises(ck.CheckpointError, match="does not exist"):
        ck.open(tmp_path / "nowhere")


def test_corrupted_chunk_names_the_tensor(tmp_path):
    save_quarters(tmp_path, torch.float32)
    data_file = tmp_path / "step_00000001" / "w" / "c" / "0" / "0"
    raw = bytearray(data_file.read_bytes())
    raw[100] ^= 0xFF
    data_file.write_bytes(bytes(raw))
    target = ck.LocalShard("w", SHAPE, (0, 0), torch.empty(SHAPE))
    with pytest.raises(ck.CheckpointError, match=r"tensor w: .*corrupted"):
        ck.load(tmp_path, [target])


def test_missing_file_fails_the_load_instead_of_reading_zeros(tmp_path):
    save_quarters(tmp_path, torch.float32)
    data_file = tmp_path / "step_00000001" / "w" / "c" / "0" / "0"
    data_file.unlink()
    target = ck.LocalShard("w", SHAPE, (0, 0), torch.empty(SHAPE))
    with pytest.raises(ck.CheckpointError, match=r"tensor w: file .* is missing.*another step"):
        ck.load(tmp_path, [target])


def test_check_compatible_names_the_field(tmp_path):
    save_quarters(tmp_path, torch.float32)
    manifest = ck.open(tmp_path).manifest
    ck.check_compatible(manifest, {"hidden_size": 64})
    with pytest.raises(ck.CheckpointError, match="model.hidden_size: checkpoint has 64, "
                                                 "run has 128"):
        ck.check_compatible(manifest, {"hidden_size": 128})
    with pytest.raises(ck.CheckpointError, match="model.num_layers"):
        ck.check_compatible(manifest, {"hidden_size": 64, "num_layers": 8})


def test_load_of_other_model_names_the_tensor(tmp_path):
    save_quarters(tmp_path, torch.float32)
    with pytest.raises(ck.CheckpointError, match=r"tensor w: .*global shape \(256, 64\)"):
        ck.load(tmp_path, [ck.LocalShard("w", (256, 64), (0, 0), torch.empty(256, 64))])
    with pytest.raises(ck.CheckpointError, match="tensor v is not in"):
        ck.load(tmp_path, [ck.LocalShard("v", SHAPE, (0, 0), torch.empty(SHAPE))])
    with pytest.raises(ck.CheckpointError, match="tensor w: the run holds bfloat16"):
        ck.load(tmp_path, [ck.LocalShard("w", SHAPE, (0, 0),
                                         torch.empty(SHAPE, dtype=torch.bfloat16))])


def test_save_rejects_bad_shards_before_writing(tmp_path):
    full = global_tensor("w", torch.float32)
    with pytest.raises(ck.CheckpointError, match="tensor w: box at .* outside"):
        ck.save(tmp_path, 1, [ck.LocalShard("w", SHAPE, (100, 0), full[:100])])
    with pytest.raises(ck.CheckpointError, match=r"no rank holds part of tensor\(s\) \['w'\]"):
        ck.save(tmp_path, 1, [rows("w", full, 0, 96)])
    with pytest.raises(ck.CheckpointError, match="not plain JSON"):
        ck.save(tmp_path, 1, [rows("w", full, 0, 192)], {"rng": torch.get_rng_state()})
    assert ck.committed_steps(tmp_path) == []


def test_manifest_is_plain_json(tmp_path):
    full = global_tensor("w", torch.float32)
    extra = {"model": {"hidden_size": 64}, "layout": {"tp": 4}, "consumed_samples": 128,
             "rng": {"seed": 1}, "optimizer": {"lr": 1e-3, "step": 7}, "note": "x"}
    ck.save(tmp_path, 5, [rows("w", full, 0, 192)], extra)
    data = json.loads((tmp_path / "step_00000005" / "manifest.json").read_text())
    assert data["format_version"] == ck.FORMAT_VERSION and data["step"] == 5
    assert data["consumed_samples"] == 128 and data["optimizer"]["step"] == 7
    assert data["extra"] == {"note": "x"}
    assert data["tensors"]["w"]["chunks"] and data["tensors"]["w"]["checksum"] == "crc32c"


def test_inspect_prints_step_layout_and_tensors(tmp_path, capsys):
    save_quarters(tmp_path, torch.bfloat16, step=12)
    assert cli_main(["inspect", os.fspath(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "step: 12" in out and "layout at save: (not recorded)" in out
    assert "192x64" in out and "bfloat16" in out and "total: 1 tensors, 24,576 bytes" in out
    assert cli_main(["inspect", os.fspath(tmp_path / "missing")]) == 2
