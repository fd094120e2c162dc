"""ZeRO-1 across heterogeneous replica sets (``runtime/distributed_optimizer.py``).

The layout-training modules' shared world (``tests/train_world.py``) runs tiny-llama
with a warm-up + cosine schedule and ``clip_grad`` low enough that every step clips:

* with and without the distributed optimizer, on a uniform bf16 layout, a
  heterogeneous bf16 layout (crossed TP splits) and a three-pipeline fp32 layout: the
  same losses and weights bit for bit, and (crossed, bf16) the same fp32 main
  parameters and moments, bit for bit, in both runs' checkpoints;
* a ZeRO-1 bf16 checkpoint of the heterogeneous layout resumed unsharded on a uniform
  layout, and an unsharded bf16 checkpoint of the uniform layout resumed under ZeRO-1
  on the three-pipeline layout: each loads the global fp32 state bit-exact and
  continues the lr schedule exactly;
* the optimizer-state bytes of every rank of the crossed layout, measured on its
  tensors, with and without sharding, against 12 bytes per parameter divided by its
  replica count; and what building each optimizer allocated: ZeRO-1 its shard (and
  the fp32 gradient buffers), never an fp32 copy of the rank's weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from elastor_mcore import checkpoint
from elastor_mcore.config.recipe import RecipeError, recipe_from_dict
from elastor_mcore.config.yaml_file import read_yaml_file
from elastor_mcore.geometry import Box, Cell
from elastor_mcore.runtime.distributed_optimizer import row_cuts, shard_buckets
from elastor_mcore.runtime.optimizer import lr_scheduler
from tests.conftest import (
    TINY, case_metrics, global_state, layout_arg, max_relative_difference, write_tiny_recipe)
from tests.train_world import TIMEOUT, TrainWorldPart

SCHEDULE = {"lr_decay_style": "cosine", "lr_warmup_iters": 2, "lr_decay_iters": 8,
            "min_lr": 3.0e-5}
CLIP = 0.5
"""Below the tiny model's gradient norms (about 0.77): every step clips."""
STEPS, RESUMED_STEPS = 3, 5
PAIRS = {"uniform-bf16": ("dp2-tp2-pp1", "bfloat16"),
         "crossed-bf16": ("two-pipelines-crossed-splits", "bfloat16"),
         "three-pipelines-fp32": ("three-pipelines-uneven", "float32")}
BUILD_SLACK = 64 * 1024
"""Bytes building ZeRO-1 may allocate for a while besides what it keeps (the plan's
collectives' buffers); the fp32 copy of rank 0's weights is 263,168 bytes."""
BF16_TOLERANCE = 5e-5
"""As ``test_mixed_precision``: ten times bf16's measured noise floor across layouts."""


def write_recipe(path: Path, params_dtype: str, zero: bool) -> Path:
    return write_tiny_recipe(path, optimizer={"clip_grad": CLIP}, params_dtype=params_dtype,
                             lr_schedule=SCHEDULE, distributed_optimizer=zero)


def train_world_part(out: Path) -> TrainWorldPart:
    ck = out / "checkpoints"
    recipes = {(dtype, zero): write_recipe(out / f"{dtype}-{zero}.yaml", dtype, zero)
               for dtype in ("float32", "bfloat16") for zero in (False, True)}
    cases = []
    for name, (layout, dtype) in PAIRS.items():
        for zero in (False, True):
            saves = name == "crossed-bf16" or (name == "uniform-bf16" and not zero)
            save = f",save={ck / name}-{zero}" if saves else ""
            cases.append(f"{name}-{zero}={layout_arg(layout)}:{STEPS},"
                         f"recipe={recipes[dtype, zero]}{save}")
    cases += [f"zero-to-plain=dp2-tp2-pp1:{RESUMED_STEPS},recipe={recipes['bfloat16', False]},"
              f"load={ck / 'crossed-bf16-True'},verify",
              f"plain-to-zero={layout_arg('three-pipelines-uneven')}:{RESUMED_STEPS},"
              f"recipe={recipes['bfloat16', True]},load={ck / 'uniform-bf16-False'},verify"]
    return TrainWorldPart(cases, memory=["crossed-bf16-False", "crossed-bf16-True"],
                          native_check=["three-pipelines-fp32-True"])


@pytest.fixture(scope="module")
def world(train_world) -> Path:
    return train_world[__name__]


def rank_weights(world: Path, name: str) -> dict[str, list]:
    """Every rank's model shards after training, by key."""
    shards: dict[str, list] = {}
    for f in sorted((world / name).glob("rank*.pt")):
        for key, (offset, tensor) in torch.load(f).items():
            shards.setdefault(key, []).append((f.name, offset, tensor))
    return shards


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("name", list(PAIRS))
def test_losses_and_weights_are_bit_identical_with_and_without_zero1(world, name):
    plain, zero = case_metrics(world, f"{name}-False"), case_metrics(world, f"{name}-True")
    assert len(plain) == STEPS
    assert all(m["grad_norm"] > CLIP for m in plain)  # the clip ran every step
    assert [m["loss"] for m in zero] == [m["loss"] for m in plain]
    assert [m["lr"] for m in zero] == [m["lr"] for m in plain]
    norm_diff = max_relative_difference([m["grad_norm"] for m in zero],
                                        [m["grad_norm"] for m in plain])
    print(f"{name}: losses bit-identical, grad norms within {norm_diff:.1e} (float64 order)")
    assert norm_diff < 1e-14
    plain_w, zero_w = rank_weights(world, f"{name}-False"), rank_weights(world, f"{name}-True")
    assert plain_w.keys() == zero_w.keys()
    for key in plain_w:
        for (rank, offset, a), (_, zero_offset, b) in zip(plain_w[key], zero_w[key]):
            assert offset == zero_offset and a.dtype == b.dtype
            assert torch.equal(a, b), f"{key} on {rank}"


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT)
def test_sharded_and_unsharded_checkpoints_hold_the_same_global_fp32_state(world):
    """The ZeRO-1 save wrote each global tensor whole (from owned boxes) and equal, bit
    for bit, to the unsharded run's: fp32 main parameters and both moments."""
    ck = world / "checkpoints"
    plain = checkpoint.open(ck / "crossed-bf16-False")
    zero = checkpoint.open(ck / "crossed-bf16-True")
    keys = sorted(t.name for t in plain.tensors())
    assert keys == sorted(t.name for t in zero.tensors())
    # ZeRO-1 cuts only at inner-chunk boundaries: the same chunks as unsharded.
    assert [t.chunks for t in plain.tensors()] == [t.chunks for t in zero.tensors()]
    assert any(k.startswith("optimizer.exp_avg_sq.") for k in keys)
    dumped = global_state(sorted((ck / "crossed-bf16-True.state").glob("rank*.pt")))
    assert sorted(dumped) == keys
    for key in keys:
        a, b = plain.read(key), zero.read(key)
        assert a.dtype == b.dtype == torch.float32, key
        assert torch.equal(a, b), key
        assert torch.equal(b, dumped[key]), key


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("case, saved", [("zero-to-plain", "crossed-bf16-True"),
                                         ("plain-to-zero", "uniform-bf16-False")])
def test_resume_across_sharding_and_layouts_is_bit_exact(world, case, saved):
    stored = checkpoint.open(world / "checkpoints" / saved)
    loaded = global_state(sorted((world / case).glob("loaded.rank*.pt")))
    assert sorted(loaded) == sorted(t.name for t in stored.tensors())
    for key, tensor in loaded.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, stored.read(key)), key
    resumed = case_metrics(world, case)
    assert [m["step"] for m in resumed] == list(range(STEPS + 1, RESUMED_STEPS + 1))
    assert [m["lr"] for m in resumed] == scheduled_lrs()[STEPS:RESUMED_STEPS]


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT)
def test_both_resumes_continue_the_same_run(world):
    """Both continue the same run (saved under two layouts, so bf16 noise apart),
    under other layouts and sharding: the same losses within bf16's tolerance."""
    a = [m["loss"] for m in case_metrics(world, "zero-to-plain")]
    b = [m["loss"] for m in case_metrics(world, "plain-to-zero")]
    diff = max_relative_difference(a, b)
    print(f"resumed losses within {diff:.1e} (bf16 tolerance {BF16_TOLERANCE:.0e})")
    assert diff <= BF16_TOLERANCE


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT)
def test_native_reduce_scatter_matches_the_emulation_to_rounding(world):
    """The NCCL path (``reduce_scatter_tensor`` of the padded buffer), run on gloo:
    the same sums up to float32 rounding (another summation order over three
    pipelines), on every rank of the three-pipeline layout."""
    reports = [json.loads(f.read_text()) for f in
               sorted((world / "three-pipelines-fp32-True").glob("native.rank*.json"))]
    assert len(reports) == 7
    differing = sum(r["differing"] for r in reports)
    worst = max(r["max_abs_diff"] / r["max_abs"] for r in reports)
    print(f"native reduce-scatter: {differing} of {sum(r['elements'] for r in reports)} "
          f"owned elements differ from the all-reduce emulation, by at most {worst:.1e} "
          f"of the largest gradient")
    assert worst <= 1e-6
    # the weights' gather: all_gather_into_tensor of the padded segments (NCCL's) and
    # the all-reduce of the zero-filled buffer (gloo's, and where padding costs more)
    # write the same bits
    assert all(r["gathered_alike"] for r in reports)


def scheduled_lrs() -> list[float]:
    """mcore's schedule for the test recipe, step by step (the uninterrupted run's)."""
    data = read_yaml_file(TINY, "recipe", RecipeError)
    data["training"]["lr_schedule"] = SCHEDULE
    recipe = recipe_from_dict(data)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=recipe.training.optimizer.lr)
    scheduler = lr_scheduler(opt, recipe)
    lrs = []
    for _ in range(RESUMED_STEPS):
        lrs.append(opt.param_groups[0]["lr"])
        scheduler.step(increment=recipe.training.global_batch_size)
    return lrs


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT)
def test_optimizer_state_bytes_per_rank_fall_by_the_replica_count(world):
    ranks = range(6)  # the crossed layout's ranks
    plain = [json.loads((world / "crossed-bf16-False" / f"memory.rank{r}.json").read_text())
             for r in ranks]
    zero = [json.loads((world / "crossed-bf16-True" / f"memory.rank{r}.json").read_text())
            for r in ranks]
    print("rank  params  unsharded B  ZeRO-1 B  formula B  ZeRO-1/formula")
    for r, (p, z) in enumerate(zip(plain, zero)):
        print(f"{r:4d} {p['params']:7d} {p['state_bytes']:12d} {z['state_bytes']:9d} "
              f"{z['formula_bytes']:10.0f}  {z['state_bytes'] / z['formula_bytes']:.3f}")
        assert not p["sharded"] and z["sharded"]
        assert p["state_bytes"] == 12 * p["params"] == p["formula_bytes"]  # all local
        assert z["state_bytes"] == z["planned_bytes"]  # measured on the tensors = the plan
        assert z["state_bytes"] < p["state_bytes"]
    # Each element of the model's state is held once across the ranks: the formula's
    # total exactly, against the unsharded total of every replica's copy.
    total = sum(z["state_bytes"] for z in zero)
    assert total == pytest.approx(sum(z["formula_bytes"] for z in zero), abs=1e-6)
    assert total < sum(p["state_bytes"] for p in plain)


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT)
def test_zero1_builds_only_its_shard(world):
    """Building ``DistributedOptimizer`` allocates the fp32 gradient buffers (as the
    plain optimizer does) and the fp32 state of the rank's shard, nothing more: the
    plain bf16 optimizer's build, which copies every weight to fp32, is measured by the
    same meter for contrast."""
    for r in range(6):
        plain = json.loads((world / "crossed-bf16-False" / f"memory.rank{r}.json").read_text())
        zero = json.loads((world / "crossed-bf16-True" / f"memory.rank{r}.json").read_text())
        print(f"rank {r}: build peak {zero['build_peak']} B (gradients {zero['grad_bytes']}, "
              f"shard {zero['shard_bytes']}), plain {plain['build_peak']} B")
        assert zero["build_kept"] == zero["grad_bytes"] + zero["shard_bytes"]
        assert zero["build_peak"] <= zero["build_kept"] + BUILD_SLACK
        assert plain["build_kept"] == plain["grad_bytes"] + 4 * plain["params"]


def test_row_cuts_are_as_even_as_rows_and_chunks_allow():
    """45 elements over 3 holders: cuts at the allowed boundaries nearest 15 and 30."""
    cells = [Cell("a", Box((0, 0), (5, 7)), (0, 1, 2)), Cell("b", Box((0,), (10,)), (0, 1, 2))]
    assert row_cuts(cells, 3, [1, 1]) == (0, 14, 28, 45)
    assert row_cuts(cells, 3, [4, 1]) == (0, 28, 28, 45)  # rows 0, 4 and the end only
    bucket, = shard_buckets(cells, lambda holders: 3, {"a": 1, "b": 1})
    assert bucket.reduces and bucket.segment_numel == 17
    assert [(f.cell.key, f.box, f.offset) for f in bucket.fragments(1)] == [
        ("a", Box((2, 0), (2, 7)), 14)]
    assert [(f.cell.key, f.box, f.offset) for f in bucket.fragments(2)] == [
        ("a", Box((4, 0), (1, 7)), 28), ("b", Box((0,), (10,)), 35)]
    one_pipeline, = shard_buckets(cells[1:], lambda holders: 1, {"b": 1})
    assert not one_pipeline.reduces and one_pipeline.cuts == (0, 3, 6, 10)
    offset_cell = [Cell("c", Box((8, 0), (8, 2)), (0, 1))]  # global rows 8..15
    assert row_cuts(offset_cell, 2, [4]) == (0, 8, 16)
    # padding to equal segments: 3 x 17 of 45 elements is cheap; one whole file over
    # three holders (3 x 16 of 16) is not, and an all-reduce replaces the padded
    # collectives
    assert bucket.pads_cheaply
    whole, = shard_buckets(offset_cell * 1, lambda holders: 2, {"c": 8})
    assert whole.cuts == (0, 0, 16) and whole.pads_cheaply  # two holders always are
    three = [Cell("c", Box((8, 0), (8, 2)), (0, 1, 2))]
    lopsided, = shard_buckets(three, lambda holders: 3, {"c": 8})
    assert lopsided.cuts == (0, 0, 16, 16) and not lopsided.pads_cheaply
