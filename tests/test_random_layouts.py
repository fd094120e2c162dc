"""Any valid rank assignment trains like one process: seeded random layouts of the tiny
recipe (pipelines, stage counts, TP per stage, layers, micro-batches, a random
permutation of the ranks, idle ranks) against the single-process reference.

The generator here is independent of the planner and of ``parallel.layout``: it only
knows the recipe's shape (8 layers, TP in {1, 2, 4}, 16 micro-batches of one sample)
and writes plain YAML. Each run draws a new base seed (shown in the test id and
printed), so the suite explores new layouts over time; a failure names its seed so
it can be replayed with ``ELASTOR_LAYOUT_SEED=<seed>``.
"""

import os
import random
import time

import pytest
import yaml

from tests.conftest import TINY, load_losses, max_relative_difference, run_world

WORLD = 8
LAYERS = 8
MICRO_BATCHES = 16
TP_CHOICES = (1, 2, 4)
TP_WEIGHTS = (3, 2, 1)  # wide stages are costly on 2 cores and fill the world fast
LAYOUTS_PER_RUN = 4
STEPS = 3
TOLERANCE = 1e-5
BASE_SEED = int(os.environ.get("ELASTOR_LAYOUT_SEED", time.time_ns() % 1_000_000))


def split(total: int, parts: int, rng: random.Random) -> list[int]:
    """``total`` as ``parts`` positive integers, uniformly among such splits."""
    cuts = sorted(rng.sample(range(1, total), parts - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, total])]


def random_layout(seed: int) -> dict:
    """A valid layout on at most ``WORLD`` ranks, ranks drawn in random order."""
    rng = random.Random(seed)
    while True:
        pipelines = rng.randint(1, 3)
        shapes = []
        for _ in range(pipelines):
            stages = rng.randint(1, 3)
            shapes.append([(rng.choices(TP_CHOICES, TP_WEIGHTS)[0], layers)
                           for layers in split(LAYERS, stages, rng)])
        used = sum(tp for shape in shapes for tp, _ in shape)
        if used <= WORLD:
            break
    ranks = rng.sample(range(WORLD), used)  # a random permutation; the rest stay idle
    layout = {"pipelines": []}
    for shape, micro in zip(shapes, split(MICRO_BATCHES, pipelines, rng)):
        stages = []
        for tp, layers in shape:
            stages.append({"tp": tp, "layers": layers, "ranks": ranks[:tp]})
            ranks = ranks[tp:]
        layout["pipelines"].append({"micro_batches": micro, "stages": stages})
    return layout


SEEDS = [BASE_SEED * 100 + i for i in range(LAYOUTS_PER_RUN)]


@pytest.fixture(scope="module")
def random_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("random-layouts")
    cases = [f"reference=dp1-tp1-pp1:{STEPS}"]
    for seed in SEEDS:
        path = out / f"layout-{seed}.yaml"
        path.write_text(yaml.safe_dump(random_layout(seed), default_flow_style=None))
        cases.append(f"seed{seed}={path}:{STEPS}")
    print(f"random layouts: base seed {BASE_SEED} (replay: ELASTOR_LAYOUT_SEED={BASE_SEED})")
    run_world(WORLD, "tests.workers.train_matrix",
              ["--recipe", str(TINY), "--out", str(out),
               *[arg for case in cases for arg in ("--case", case)]], timeout=900)
    return out


@pytest.mark.slow
@pytest.mark.timeout(1000)
@pytest.mark.parametrize("seed", SEEDS, ids=[f"seed{s}" for s in SEEDS])
def test_random_layout_matches_one_process(random_runs, seed):
    layout = (random_runs / f"layout-{seed}.yaml").read_text()
    reference = load_losses(random_runs / "reference" / "metrics.json")
    losses = load_losses(random_runs / f"seed{seed}" / "metrics.json")
    difference = max_relative_difference(losses, reference)
    print(f"seed {seed}: max relative loss difference {difference:.2e}\n{layout}")
    assert difference <= TOLERANCE, f"layout of seed {seed}:\n{layout}"
