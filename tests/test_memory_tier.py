"""The in-memory tier holds exactly what a checkpoint of the same step holds, described
by global boxes, so any layout can take it.

In the shared training world (``tests/train_world.py``) two seeded random layouts (the
generator of ``test_random_layouts``; a new base seed per run, shown in the test ids,
replayed with ``ELASTOR_LAYOUT_SEED``) train with the tier on, one unsharded and one
under ZeRO-1, and save a zarr checkpoint of their last step. Every rank's own copies,
and separately the replicas its partner holds, reassemble bit for bit into the
checkpoint's global tensors. Then two other random layouts restore from those copies
in the same processes (``runtime.reshard``): across layouts and across optimizers,
peer to peer; with every even rank's copies dropped, what no copy holds comes from
the checkpoint; with all dropped, everything does. Each restored state equals the
checkpoint bit for bit.
"""

import json
from pathlib import Path

import pytest
import torch
import yaml

from elastor_mcore import checkpoint
from elastor_mcore.geometry import Box, ShardInfo
from elastor_mcore.runtime.memory_tier import (Holding, RestoreError, buffer_layout,
                                               replica_partners)
from elastor_mcore.runtime.reshard import plan_restore
from tests.conftest import global_state, write_tiny_recipe
from tests.test_random_layouts import BASE_SEED, random_layout
from tests.train_world import TIMEOUT, TrainWorldPart

STEPS = 3
SEEDS = {"fp32": BASE_SEED * 100 + 11, "zero": BASE_SEED * 100 + 12}
"""The layouts that train with the tier, by optimizer (unsharded, ZeRO-1)."""
RESTORES = {
    # name: (copies of, layout seed, optimizer of the new layout, drop, from the checkpoint)
    "into-fp32": ("fp32", BASE_SEED * 100 + 13, "fp32", None),
    "zero-into-fp32": ("zero", BASE_SEED * 100 + 14, "fp32", None),
    "into-zero-half-durable": ("fp32", BASE_SEED * 100 + 15, "zero", "even"),
    "all-durable": ("fp32", BASE_SEED * 100 + 16, "fp32", "all"),
}


def write_layout(out: Path, seed: int) -> Path:
    path = out / f"layout-{seed}.yaml"
    path.write_text(yaml.safe_dump(random_layout(seed), default_flow_style=None))
    return path


def train_world_part(out: Path) -> TrainWorldPart:
    recipes = {"fp32": write_tiny_recipe(out / "fp32.yaml"),
               "zero": write_tiny_recipe(out / "zero.yaml", distributed_optimizer=True)}
    cases = [f"tier-{name}={write_layout(out, seed)}:{STEPS},recipe={recipes[name]},tier,"
             f"save={out / f'ckpt-{name}'}" for name, seed in SEEDS.items()]
    for name, (source, seed, optimizer, drop) in RESTORES.items():
        spec = (f"{name}={write_layout(out, seed)}:{STEPS},recipe={recipes[optimizer]},"
                f"restore=tier-{source}")
        if drop:
            spec += f",drop={drop},durable={out / f'ckpt-{source}'}"
        cases.append(spec)
    return TrainWorldPart(cases)


@pytest.fixture(scope="module")
def runs(train_world) -> Path:
    print(f"memory tier layouts: base seed {BASE_SEED} (replay: ELASTOR_LAYOUT_SEED="
          f"{BASE_SEED})")
    return train_world[__name__]


def saved(runs: Path, name: str) -> dict[str, torch.Tensor]:
    reader = checkpoint.open(runs / f"ckpt-{name}")
    assert reader.manifest.step == STEPS
    return {t.name: reader.read(t.name) for t in reader.tensors()}


def assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key


def copies_as_shards(runs: Path, name: str, own: bool, step: int) -> list[Path]:
    """The copies of step ``step`` every rank of case ``name`` holds, its own or the
    replicas, as shard files for ``global_state``."""
    files = []
    for path in sorted((runs / f"tier-{name}").glob("copies.rank*.pt")):
        rank = int(path.stem.removeprefix("copies.rank"))
        shards = [s for c in torch.load(path) if c["step"] == step
                  and (c["owner"] == rank) == own for s in c["shards"]]
        out = path.with_name(f"{'own' if own else 'replica'}{step}.rank{rank}.pt")
        torch.save(shards, out)
        files.append(out)
    return files


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("name", SEEDS, ids=[f"{n}-seed{s}" for n, s in SEEDS.items()])
def test_memory_copies_reassemble_to_the_checkpoint(runs, name):
    layout = (runs / f"layout-{SEEDS[name]}.yaml").read_text()
    print(f"{name}, layout of seed {SEEDS[name]}:\n{layout}")
    want = saved(runs, name)
    held = {(c["owner"], c["step"]) for path in (runs / f"tier-{name}").glob("copies.rank*.pt")
            for c in torch.load(path)}
    assert {step for _, step in held} == {STEPS - 1, STEPS}, "two versions are kept"
    assert_bit_equal(global_state(copies_as_shards(runs, name, own=True, step=STEPS)), want)
    if len({owner for owner, _ in held}) > 1:  # one active rank alone has no partner
        assert_bit_equal(global_state(copies_as_shards(runs, name, own=False, step=STEPS)),
                         want)


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("name", RESTORES)
def test_restore_into_another_layout_equals_the_checkpoint(runs, name):
    source, seed, _, drop = RESTORES[name]
    print(f"{name}: copies of seed {SEEDS[source]} into the layout of seed {seed}:\n"
          f"{(runs / f'layout-{seed}.yaml').read_text()}")
    case = runs / name
    reports = [json.loads(p.read_text()) for p in sorted(case.glob("restored.rank*.json"))]
    assert reports and all(r["step"] == STEPS for r in reports)
    assert_bit_equal(global_state(sorted(case.glob("restored.rank*.pt"))), saved(runs, source))
    durable = sum(r["durable_cells"] for r in reports)
    if drop is None:
        assert durable == 0, "every cell is in memory"
    elif drop == "all":
        assert durable > 0 and all(r["received_bytes"] == 0 for r in reports)
    print(f"{name}: {durable} cells from the checkpoint, "
          f"{sum(r['received_bytes'] for r in reports)} bytes from peers")


# ----- the pure parts, without a world ------------------------------------------------

def holding(owner: int, step: int, *boxes: tuple[int, int]) -> Holding:
    """A copy of rows ``[a, b)`` of an 8 x 2 tensor ``w`` per box."""
    infos = tuple(ShardInfo("w", (8, 2), Box((a, 0), (b - a, 2)), "float32") for a, b in boxes)
    return Holding(owner, step, infos, buffer_layout(infos)[0], {"num_steps": step})


def needs(*boxes: tuple[int, int]) -> list[ShardInfo]:
    return [ShardInfo("w", (8, 2), Box((a, 0), (b - a, 2)), "float32") for a, b in boxes]


def test_replica_partners_land_on_another_node():
    two_nodes = replica_partners(range(8), {r: r // 4 for r in range(8)})
    assert sorted(two_nodes.values()) == list(range(8))  # a ring: every rank is someone's
    assert all(r // 4 != p // 4 for r, p in two_nodes.items())
    uneven = replica_partners([0, 1, 2, 5], {0: 0, 1: 0, 2: 0, 5: 1})
    assert sum(r // 4 != p // 4 for r, p in uneven.items()) == 2  # as many as 3 + 1 allow
    assert replica_partners([3, 1], {3: 0, 1: 0}) == {1: 3, 3: 1}
    assert replica_partners([3], {3: 0}) == {3: 3}


def test_restore_plan_takes_the_newest_step_the_copies_cover():
    # Rank 0 holds rows 0-4 at steps 4 and 5; rank 1 rows 4-8 at step 4 only (its step-5
    # copy was being written): step 5 is not covered, step 4 is.
    held = {0: [holding(0, 5, (0, 4)), holding(0, 4, (0, 4))], 1: [holding(1, 4, (4, 8))]}
    plan = plan_restore(held, {0: needs((0, 8)), 1: needs((2, 6))}, durable_step=None)
    assert plan.step == 4 and plan.schedule == {"num_steps": 4}
    by = {(m.dst, m.box.offset[0]): m.src for m in plan.moves}
    # Cut at every box's edge (0, 2, 4, 6, 8): each rank keeps the rows it holds itself
    # and receives the others from their holder.
    assert by == {(0, 0): 0, (0, 2): 0, (0, 4): 1, (0, 6): 1, (1, 2): 0, (1, 4): 1}
    assert plan.durable_cells() == 0
    # With the durable checkpoint at step 5, step 5 is covered: rows 4-8 come from it.
    plan = plan_restore(held, {0: needs((0, 8))}, durable_step=5)
    assert plan.step == 5
    assert {(m.box.offset[0], m.src) for m in plan.moves} == {(0, 0), (4, None)}


def test_restore_plan_spreads_cells_held_twice():
    held = {0: [holding(0, 3, (0, 8))], 1: [holding(1, 3, (0, 8))]}
    plan = plan_restore(held, {2: needs((0, 4), (4, 8))}, durable_step=None)
    assert sorted(m.src for m in plan.moves) == [0, 1]


def test_restore_plan_refuses_what_nothing_covers():
    with pytest.raises(RestoreError, match="no step can be rebuilt"):
        plan_restore({0: [holding(0, 3, (0, 4))]}, {0: needs((0, 8))}, durable_step=None)
