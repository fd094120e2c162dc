"""``tools/bench_scale.py``'s simulated shards are mcore's: ``layout_shard_infos``
against the real ``sharded_state_dict()`` state of the tiny model, saved by every rank
of a heterogeneous layout with permuted ranks and idle ones (a case of the shared
torchrun world, ``tests/train_world.py``), and its ZeRO-1 state (``--zero1``) against
the same layout's ``DistributedOptimizer``; and the tool itself on a small world."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from elastor_mcore.config.recipe import load_recipe
from elastor_mcore.parallel.layout import load_layout
from elastor_mcore.parallel.shards import layout_shard_infos
from tests.conftest import write_tiny_recipe
from tests.train_world import TIMEOUT, TrainWorldPart

REPO = Path(__file__).resolve().parent.parent
RECIPE = load_recipe(REPO / "recipes/tiny-llama.yaml")
LAYOUT = {"pipelines": [  # two pipelines split differently; ranks 2 and 5 idle
    {"micro_batches": 9, "stages": [{"tp": 2, "layers": 2, "ranks": [6, 1]},
                                    {"tp": 1, "layers": 6, "ranks": [4]}]},
    {"micro_batches": 7, "stages": [{"tp": 1, "layers": 5, "ranks": [0]},
                                    {"tp": 4, "layers": 3, "ranks": [7, 3, 5, 2]}]},
]}


def train_world_part(out: Path) -> TrainWorldPart:
    path = out / "permuted.yaml"
    path.write_text(yaml.safe_dump(LAYOUT))
    zero1 = write_tiny_recipe(out / "zero1.yaml", distributed_optimizer=True)
    return TrainWorldPart([f"shards={path}:0,save={out / 'saved'}",
                           f"shards-zero1={path}:0,recipe={zero1},save={out / 'saved-zero1'}"])


@pytest.fixture(scope="module")
def world(train_world) -> Path:
    return train_world[__name__]


def saved_shards(path: Path) -> list[tuple]:
    """A rank's saved state (``train_matrix``'s ``DIR.state/rank<r>.pt``) as sorted
    (key, global shape, offset, shape, dtype)."""
    return sorted((key, tuple(shape), tuple(offset), tuple(data.shape),
                   str(data.dtype).removeprefix("torch."))
                  for key, shape, offset, data in torch.load(path))


def described(infos) -> list[tuple]:
    return sorted((i.key, i.global_shape, i.box.offset, i.box.shape, i.dtype) for i in infos)


@pytest.mark.timeout(TIMEOUT)
def test_simulated_shards_are_the_models(world):
    layout = load_layout(world / "permuted.yaml", RECIPE)
    for rank in layout.ranks:
        simulated = described(layout_shard_infos(RECIPE.model, layout, rank))
        assert simulated == saved_shards(world / "saved.state" / f"rank{rank}.pt"), rank


@pytest.mark.timeout(TIMEOUT)
def test_simulated_zero1_shards_are_the_distributed_optimizers(world):
    """Under ZeRO-1 each simulated rank holds the rows its ``DistributedOptimizer``
    checkpoints (``runtime.state.state_shards``): the same boxes, each element of the
    job once."""
    layout = load_layout(world / "permuted.yaml", RECIPE)
    from tools import bench_scale

    state = bench_scale.state_of(RECIPE, layout, zero1=True)
    for rank in layout.ranks:
        real = saved_shards(world / "saved-zero1.state" / f"rank{rank}.pt")
        assert described(state(rank)) == real, rank
    held = sum(math.prod(i.box.shape) for rank in layout.ranks for i in state(rank))
    shapes = {i.key: i.global_shape for rank in layout.ranks
              for i in layout_shard_infos(RECIPE.model, layout, rank)}
    assert held == sum(math.prod(shape) for shape in shapes.values())


@pytest.mark.timeout(TIMEOUT)
def test_zero1_saves_the_files_of_the_replicated_state(world):
    """ZeRO-1 cuts its segments at the file rows of an unsharded save
    (``distributed_optimizer.file_rows``) and saves with the layout's grid
    (``runtime.state.state_replicas``): its checkpoint has the replicated state's
    entries (the same files, however many replicas share a tensor), and every
    simulated rank's rows are whole files of them."""
    from elastor_mcore import checkpoint
    from elastor_mcore.geometry import grid_cut

    entries = checkpoint.open(world / "saved").manifest.tensors
    assert checkpoint.open(world / "saved-zero1").manifest.tensors == entries
    layout = load_layout(world / "permuted.yaml", RECIPE)
    from tools import bench_scale

    state = bench_scale.state_of(RECIPE, layout, zero1=True)
    files = 0
    for rank in layout.ranks:
        for info in state(rank):
            shard = entries[info.key].shard
            for box in grid_cut(info.box, shard):
                assert all(o % s == 0 and n == min(s, g - o) for o, n, s, g in zip(
                    box.offset, box.shape, shard, info.global_shape)), (info, box)
                files += 1
    assert files == sum(entry.num_files for entry in entries.values())


def test_simulated_gather_costs_a_rank_that_sends_nothing_its_bitmap_alone():
    """``SimComm.gather`` counts ``Comm.gather`` as it moves bytes: every rank an
    ``all_reduce`` of 8 bytes per 64 ranks plus its error count (a ring moving twice
    its buffer each way), the senders their size and message to the coordinator, which
    receives them all; no size vector of 4 bytes per rank."""
    from tools import bench_scale

    for world in (512, 16384):
        sim = bench_scale.SimComm(list(range(world)))
        sim.gather("plan", 0, {0: 50, 3: 100, 7: 40})
        bitmap = 2 * 8 * (1 + world // 64)
        assert sim.sent == {**dict.fromkeys(range(world), bitmap), 3: bitmap + 108,
                            7: bitmap + 48}
        assert sim.received == {**dict.fromkeys(range(world), bitmap), 0: bitmap + 156}
        assert [c.call for c in sim.log] == ["all_reduce (senders)"]


@pytest.mark.timeout(300)
def test_bench_scale_runs(tmp_path):
    """The tool on its smallest world: every plan, counted and timed."""
    def run(name: str, *flags: str) -> dict:
        """The tool's one row for 8B at 64 GPUs after 1 lost, with ``flags``."""
        out = tmp_path / f"{name}.json"
        subprocess.run([sys.executable, str(REPO / "tools/bench_scale.py"), "--models",
                        "llama3-8b", "--worlds", "64", "--lost", "1", "--samples", "1",
                        *flags, "--out", str(out)], check=True, cwd=REPO, capture_output=True)
        [row] = json.loads(out.read_text())["rows"]
        return row

    row = run("scale")
    out = tmp_path / "scale.json"
    save, [failure] = row["save_uniform"], row["failures"]
    assert save["ranks"] == 64 and save["job_wide_steps"] == 2
    assert failure["planner"]["gpus_used"] <= 63
    # the layout after 1 lost has a pipeline of its own shape: ranks in no class read
    # their own targets, and the load is the announcement and the agreement alone
    assert 0 < failure["load"]["classes_of_one"] < failure["load"]["ranks"]
    assert failure["load"]["calls"] == ["plan: all_reduce", "agree: all_reduce"]
    assert save["max_exchanged_bytes"] > 0 and save["manifest_bytes"] > 0
    # its save: classes of one beside classes of two or more, which alone set the
    # columns; each call's bytes, whose sum bounds the largest rank's
    lone = failure["save"]
    assert 0 < lone["classes_of_one"] < lone["ranks"] and lone["columns"] >= 2
    assert [call for call, _, _ in lone["call_bytes"]] == lone["calls"]
    assert 0 < lone["largest_rank_sent_bytes"] <= sum(sent for _, sent, _ in lone["call_bytes"])
    tables = {flag: subprocess.run(
        [sys.executable, str(REPO / "tools/bench_scale.py"), *flag.split(), str(out)],
        check=True, cwd=REPO, capture_output=True, text=True).stdout
        for flag in ("--table", "--planner-table")}
    assert f"| 64 | lost 1 | {failure['save']['ranks']} | " in tables["--table"]
    assert f"| llama3-8b | 64 | 1 | {failure['planner']['cpu_s']:.3f} | " in tables["--planner-table"]
    [sharded] = run("zero1", "--only", "save", "--zero1")["failures"]
    # ZeRO-1's save: its own plan per rank and the entries gathered to the coordinator
    # (a bitmap all_reduce, then point to point), in the replicated state's files
    assert sharded["save"]["calls"] == [
        "plan: all_reduce (senders)", "finish: all_reduce", "finish: broadcast_object_list"]
    assert sharded["save"]["files"] == failure["save"]["files"]
    assert sharded["save"]["owning_ranks"] <= sharded["save"]["ranks"]
    row = run("megatron", "--only", "save,load", "--megatron-lm")
    [mixed] = row["failures"]
    assert "save_uniform" not in row  # Megatron's own distributed optimizer runs there
    # Megatron-LM's state: weights through the classes' owners, ZeRO-1's state on its
    # grid, the named files, all in the replicated save's 2 steps; a class load
    exchange = ["plan: all_to_all_single (sizes)", "plan: all_to_all_single (messages)"]
    assert mixed["save"]["calls"] == [*exchange, *exchange, "finish: all_reduce",
                                      "finish: broadcast_object_list"]
    assert mixed["save"]["named_files"] > 1 and mixed["save"]["tensors"] > failure["save"][
        "tensors"]
    assert mixed["load"]["calls"] == ["plan: all_reduce", "agree: all_reduce"]
    [restore] = run("restore", "--only", "restore", "--before")["failures"]
    # the in-place restore planned by the tensors' owners: the whole-job plan's cells,
    # in two exchanges and three integer all_reduces, where it gathered every rank's
    assert restore["restore"]["moves"] == restore["restore"]["before"]["moves"] > 0
    assert restore["restore"]["job_wide_calls"] == 7
    assert restore["restore"]["before"]["calls"] == ["plan: all_gather_object"]
