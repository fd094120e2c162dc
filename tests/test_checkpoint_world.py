"""Checkpoint save/load across a 4-rank gloo world (library level, no mcore model).

One world runs every case (see ``tests/workers/checkpoint_world.py``): save from TP-4
quarters held twice each, load as halves / 3-way uneven / whole, load with replica
classes under seeded random layouts and with false ones, save from a sub-group.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.checkpoint_checks import (
    MAX_READ_AMPLIFICATION, amplification, assert_balanced, assert_units_tile)
from tests.conftest import run_world


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt_world")
    run_world(4, "tests.workers.checkpoint_world", ["--out", str(out)], timeout=240)
    return {**json.loads((out / "result.json").read_text()), "root": str(out)}


PASSES = ("one host", "a host per rank")
"""The worker's load passes (see ``tests/workers/checkpoint_world.py``)."""


def job_read_amplification(world, hosts: str, layout: str) -> float:
    """Bytes all ranks read from storage in one load over the unique bytes needed."""
    loads = [report[hosts][layout] for report in world["ranks"]]
    unique = loads[0]["tensor_bytes"]
    assert sum(load["bytes_needed"] for load in loads) >= 2 * unique  # replicas exist
    return amplification(sum(load["bytes_read"] for load in loads), unique)


@pytest.mark.timeout(300)
def test_the_exchange_delivers_messages_of_any_size_intact(world):
    """``Comm.exchange`` pads each message to its size class and sends the class as one
    byte: seeded random messages of 0 to 300 KB between every pair of ranks arrive as
    sent (``tests/workers/checkpoint_world.py``, ``exchanges``)."""
    assert [r["exchange"] for r in world["ranks"]] == [[]] * 4


def test_size_classes_cover_every_message_with_little_padding():
    from elastor_mcore.checkpoint import comm

    sizes = comm.SIZE_CLASSES
    assert len(sizes) == 256 and sizes[0] == 0 and sizes[-1] >= 2**31
    assert all(b > a for a, b in zip(sizes, sizes[1:]))
    for n in [0, 1, 2, 63, 64, 1000, 123_457, 10**6, 2**31 - 1, *sizes[1:50]]:
        padded = sizes[comm.size_class(n)]
        assert n <= padded <= max(n + 1, 1.08 * n + 1), n
        assert comm.size_class(n) == 0 or sizes[comm.size_class(n) - 1] < n, n
    with pytest.raises(comm.CheckpointError, match="size classes"):
        comm.size_class(sizes[-1] + 1)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["halves", "uneven", "whole"])
def test_resharded_load_is_bit_exact(world, layout):
    for report in world["ranks"]:
        for hosts in set(PASSES) & set(report):
            assert report[hosts][layout]["mismatches"] == [], (report["rank"], hosts)


@pytest.mark.timeout(300)
def test_every_array_has_zarr_metadata_whoever_wrote_it(world):
    """The ranks create the metadata of the arrays whose first file they write: plain
    TensorStore (reading each ``zarr.json``, not the manifest) opens every array."""
    import tensorstore as ts

    from elastor_mcore import checkpoint as ck
    from elastor_mcore.checkpoint import plan
    from elastor_mcore.geometry import Box

    step = Path(world["root"]) / "world" / "step_00000003"
    units = [ck.WriteUnit(key, Box(tuple(offset), tuple(shape)), tuple(holders), 0, writer)
             for key, offset, shape, holders, writer in world["units"]]
    creators = set(plan.metadata_creators(ck.WritePlan({}, units)).values())
    assert len(creators) > 1, "every array's metadata came from one rank: nothing tested"
    for info in ck.open(step).tensors():
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(step / info.name)}}
        array = ts.open(spec, open=True).result()
        assert (tuple(array.shape), array.dtype.name) == (info.shape, info.dtype), info.name
        assert tuple(array.chunk_layout.read_chunk.shape) == info.chunks, info.name


@pytest.mark.timeout(300)
def test_each_cell_written_once_and_spread(world):
    assert_units_tile(world["units"], {k: tuple(v) for k, v in world["shapes"].items()})
    assert all(writer in holders for *_, holders, writer in world["units"])
    assert_balanced(world["bytes_by_rank"])


@pytest.mark.timeout(300)
def test_aligned_reshard_reads_only_what_it_needs(world):
    for report in world["ranks"]:
        halves = report["one host"]["halves"]
        assert amplification(halves["bytes_read"], halves["bytes_needed"]) \
            <= MAX_READ_AMPLIFICATION


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["halves", "whole"])
def test_replicas_on_other_hosts_read_once_per_job(world, layout):
    """Ranks on different hosts needing the same bytes (replicas) share one read:
    storage serves the job each byte about once, not once per replica."""
    assert job_read_amplification(world, "a host per rank", layout) <= MAX_READ_AMPLIFICATION


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["halves", "whole"])
def test_replicas_on_one_host_read_their_own_bytes(world, layout):
    """Replicas sharing a page cache each read what they need (the kernel reads the
    bytes from storage once): each reads all it needs itself."""
    for report in world["ranks"]:
        load = report["one host"][layout]
        assert amplification(load["bytes_read"], load["bytes_needed"]) \
            <= MAX_READ_AMPLIFICATION
        assert load["bytes_read"] >= load["bytes_needed"]


@pytest.mark.timeout(300)
def test_class_loads_match_a_single_process_read(world):
    """Loads with seeded random replica classes (members sharing their class's reads,
    a rank in no class a class of its own, reading its own targets): every rank's
    targets equal a single-process read of the checkpoint, bit for bit."""
    seeds = world["ranks"][0]["classes"]["seeds"]
    assert len(seeds) >= 6 and any(len(c) > 1 for s in seeds.values() for c in s["classes"])
    assert any(len(c) == 1 for s in seeds.values() for c in s["classes"])
    for report in world["ranks"]:
        for seed, load in report["classes"]["seeds"].items():
            assert load["mismatches"] == [], (report["rank"], seed)


@pytest.mark.timeout(300)
def test_a_class_load_is_two_all_reduces_with_ranks_in_no_class_too(world):
    """A load with replica classes makes 2 job-wide calls, the announcement and the
    agreement (two ``all_reduce``s), and no ``all_to_all``, whether or not some ranks
    are in no class (they read their own targets: no owner plans for them)."""
    seeds = world["ranks"][0]["classes"]["seeds"]
    assert any(len(c) == 1 for s in seeds.values() for c in s["classes"])
    for report in world["ranks"]:
        for seed, load in report["classes"]["seeds"].items():
            assert load["calls"] == {"all_to_all_single": 0, "all_reduce": 2,
                                     "all_gather_object": 0, "broadcast_object_list": 0}, (
                report["rank"], seed, load["calls"])


@pytest.mark.timeout(300)
def test_a_class_on_other_hosts_reads_its_bytes_once(world):
    """Members of a class on different hosts split their class's reads: together they
    read from storage what one of them alone reads, not once per member."""
    checked = 0
    for seed, first in world["ranks"][0]["classes"]["seeds"].items():
        if first["hosts"] != "a host per rank":
            continue
        loads = {r["rank"]: r["classes"]["seeds"][seed] for r in world["ranks"]}
        for members in first["classes"]:
            alone = loads[members[0]]["bytes_alone"]
            if len(members) < 2 or not alone:
                continue
            together = sum(loads[m]["bytes_read"] for m in members)
            assert together <= MAX_READ_AMPLIFICATION * alone, (seed, members, together, alone)
            checked += 1
    assert checked, "no class of two or more on separate hosts held anything"


@pytest.mark.timeout(300)
def test_a_disjoint_load_reads_its_own_bytes_through_no_owner(world):
    """``Replicas(disjoint=True)``, as the trainer passes under ZeRO-1: each rank's
    targets equal the checkpoint bit for bit, it reads from storage what a
    single-process read of its targets reads, and no ``all_to_all`` runs (no owner
    plans the reads); targets that overlap after all still load right."""
    for report in world["ranks"]:
        load = report["classes"]["disjoint"]
        assert load["held"] > 0, report["rank"]
        assert load["mismatches"] == [] and load["overlapping_mismatches"] == [], load
        assert load["all_to_all"] == 0, load
        assert load["bytes_read"] == load["bytes_alone"] > 0, load


@pytest.mark.timeout(300)
def test_a_disjoint_save_with_a_grid_writes_the_replicated_files_through_no_owner(world):
    """``Replicas(disjoint=True, grid=...)``, as the trainer saves ZeRO-1's state: the
    step reads back bit for bit, with the entries (files) of the replicated save of
    the same quarters, and its 2 job-wide steps are 3 calls: the plan's gather of the
    entries to the coordinator (an ``all_reduce`` of a bitmap of the senders, then
    point to point), the finish's ``all_reduce`` and its ``broadcast``; no
    ``all_to_all`` (whose size vector grew with the group), synchronous or not."""
    for report in world["ranks"]:
        save = report["disjoint_save"]
        assert save["mismatches"] == [] and save["entries_match"], save
        assert save["async_mismatches"] == [] and save["async_all_to_all"] == 0, save
        assert save["calls"] == {"all_to_all_single": 0, "all_reduce": 2,
                                 "all_gather_object": 0, "broadcast_object_list": 1}, save
    # a piece of each split tensor on every rank, the replicated one on rank 0
    assert [r["disjoint_save"]["held"] for r in world["ranks"]] == [5, 4, 4, 4]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case, expected", [
    ("off the files", "is not a union of its files"),
    ("a file twice", "write it twice"), ("files never written", "unwritten"),
    ("async files never written", "unwritten"),
    ("bad shards on two ranks", "failed on 2 rank(s): rank 0: tensor embedding")])
def test_a_wrong_disjoint_claim_fails_the_save_on_every_rank(world, case, expected):
    """Disjoint shards cut off the grid's files, or that overlap or leave a gap, or bad
    shards on two ranks (their errors travel in the plan's gather): the save raises
    ``CheckpointError`` on every rank before its manifest is written (an asynchronous
    save's gap at the wait for it), naming every failed rank."""
    for report in world["ranks"]:
        assert expected in report["disjoint_save"][case], (report["rank"], case)
    bad = world["ranks"][1]["disjoint_save"]["bad shards on two ranks"]
    assert "| rank 2: tensor embedding" in bad, bad


@pytest.mark.timeout(300)
def test_mixed_state_saves_and_loads_in_two_steps_each(world):
    """Replica classes beside a grid (Megatron-LM's weights and ZeRO-1's optimizer
    state), on seeded random classes: the save reads back bit for bit, the grid's
    tensor with the replicated save's entry; the save is the two exchanges and the
    finish (its disjoint entries ride the first exchange to the coordinator), the
    load the announcement and the agreement; each named file is written once, by a
    rank that offered it, with the bytes it offered."""
    seeds = world["ranks"][0]["mixed"]["seeds"]
    assert any(len(c) == 1 for s in seeds.values() for c in s["classes"])
    assert any(len(c) > 1 for s in seeds.values() for c in s["classes"])
    for report in world["ranks"]:
        for seed, case in report["mixed"]["seeds"].items():
            where = (report["rank"], seed)
            assert case["mismatches"] == [] and case["load_mismatches"] == [], where
            assert case["grid_entry_matches"], where
            assert case["calls"] == {"all_to_all_single": 4, "all_reduce": 1,
                                     "all_gather_object": 0, "broadcast_object_list": 1}, where
            assert case["load_calls"] == {"all_to_all_single": 0, "all_reduce": 2,
                                          "all_gather_object": 0,
                                          "broadcast_object_list": 0}, where
            assert set(case["files_written"]) <= set(case["offered"]), where
            for name in case["offered"]:
                expected = "plain values" if name == "common.pt" else \
                    f"stage of {tuple(next(c for c in case['classes'] if report['rank'] in c))}"
                assert case["files"][name] == expected, (where, name)
    for seed in seeds:
        written = [name for r in world["ranks"] for name in r["mixed"]["seeds"][seed]
                   ["files_written"]]
        offered = {name for r in world["ranks"] for name in r["mixed"]["seeds"][seed]["offered"]}
        assert sorted(written) == sorted(offered), (seed, written)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case, expected", [
    ("member off its class", "do not tile its box"),
    ("grid shard off its files", "is not a union of its files")])
def test_a_wrong_mixed_claim_fails_the_save_on_every_rank(world, case, expected):
    """A class member whose weights differ from its class's, or a grid tensor's shard
    cut off its files: the mixed save raises on every rank before its manifest."""
    for report in world["ranks"]:
        assert expected in report["mixed"][case], (report["rank"], report["mixed"][case])


def test_a_class_save_with_ranks_alone_reads_back_bit_exact(world):
    """Saves with seeded replica classes, some of one rank beside classes of two or
    more, so several columns (a class of one sends its shards to every column's owner
    and hears from column 0): each step reads back bit for bit, in a save's 2
    job-wide steps (the plan's two exchanges, the finish's ``all_reduce`` and
    ``broadcast``)."""
    seeds = world["ranks"][0]["class_saves"]
    mixed = [seed for seed, save in seeds.items()
             if any(len(c) == 1 for c in save["classes"]) and save["columns"] >= 2]
    assert len(mixed) >= 2, seeds
    for report in world["ranks"]:
        for seed, save in report["class_saves"].items():
            assert save["mismatches"] == [], (report["rank"], seed)
            assert save["calls"] == {"all_to_all_single": 4, "all_reduce": 1,
                                     "all_gather_object": 0, "broadcast_object_list": 1}, (
                report["rank"], seed, save["calls"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["false class", "classes differ between ranks"])
def test_a_wrong_replica_class_fails_on_every_rank(world, case):
    """Members that hold different boxes, or ranks that pass different classes: the
    load raises ``CheckpointError`` on every rank (it neither hangs nor loads)."""
    expected = {"false class": "hold other targets",
                "classes differ between ranks": "different replica classes"}[case]
    for report in world["ranks"]:
        assert expected in report["classes"][case], (report["rank"], report["classes"][case])


@pytest.mark.timeout(300)
def test_subgroup_save_without_idle_rank(world):
    for report in world["ranks"]:
        assert report["subgroup"] == {"mismatches": [], "writers": 3}
