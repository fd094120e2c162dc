"""The common refinement against a per-element reference, on seeded random boxes."""

import random

import numpy as np
import pytest

from elastor_mcore.geometry import Box, ShardInfo, common_refinement, grid_cut


def _random_box(rng: random.Random, shape: tuple[int, ...]) -> Box:
    lo = [rng.randrange(n) for n in shape]
    return Box(tuple(lo), tuple(rng.randint(1, n - o) for o, n in zip(lo, shape)))


def _holders_per_element(shape, boxes_by_rank) -> np.ndarray:
    """Reference: for every element, the set of ranks whose boxes cover it (as a bit mask)."""
    mask = np.zeros(shape, dtype=np.int64)
    for rank, boxes in boxes_by_rank.items():
        covered = np.zeros(shape, dtype=bool)
        for box in boxes:
            covered[box.slices()] = True
        mask |= covered.astype(np.int64) << rank
    return mask


@pytest.mark.parametrize("seed", range(40))
def test_cells_partition_the_held_elements_by_holder_set(seed):
    rng = random.Random(seed)
    shape = tuple(rng.randint(1, 12) for _ in range(rng.randint(0, 3)))
    ranks = rng.sample(range(16), rng.randint(1, 6))
    boxes_by_rank = {r: [_random_box(rng, shape) for _ in range(rng.randint(0, 2))]
                     for r in ranks}
    infos = {r: [ShardInfo("t", shape, b, "float32") for b in boxes]
             for r, boxes in boxes_by_rank.items()}
    cells = common_refinement(infos)

    expected = _holders_per_element(shape, boxes_by_rank)
    seen = np.zeros(shape, dtype=np.int64)
    for cell in cells:
        mask = sum(1 << r for r in cell.holders)
        assert cell.holders == tuple(sorted(cell.holders)) and cell.holders
        assert (expected[cell.box.slices()] == mask).all(), (seed, cell)
        seen[cell.box.slices()] += 1
    assert ((seen == 1) == (expected != 0)).all() and seen.max(initial=0) <= 1, seed
    # every cell lies between consecutive boundaries (no coarser cut would keep the
    # holder sets uniform in general, and no finer one is needed)
    points = [sorted({0, n} | {x for bs in boxes_by_rank.values() for b in bs
                               for x in (b.offset[d], b.offset[d] + b.shape[d])})
              for d, n in enumerate(shape)]
    for cell in cells:
        for d, (o, n) in enumerate(zip(cell.box.offset, cell.box.shape)):
            assert points[d][points[d].index(o) + 1] == o + n
    assert cells == sorted(cells, key=lambda c: c.box.offset)
    assert common_refinement(dict(reversed(list(infos.items())))) == cells  # deterministic


@pytest.mark.parametrize("seed", range(20))
def test_grid_cut_tiles_the_box_along_the_grid(seed):
    """``grid_cut``'s pieces tile the box exactly, and each lies in one cell of the
    grid (a file), whatever the box's alignment."""
    rng = random.Random(seed)
    shape = tuple(rng.randint(1, 12) for _ in range(rng.randint(1, 3)))
    step = tuple(rng.randint(1, n) for n in shape)
    box = _random_box(rng, shape)
    count = np.zeros(shape, dtype=np.int64)
    for piece in grid_cut(box, step):
        assert box.contains(piece) and piece.numel > 0
        assert all(o // n == (o + s - 1) // n for o, s, n in zip(piece.offset, piece.shape, step))
        count[piece.slices()] += 1
    inside = np.zeros(shape, dtype=np.int64)
    inside[box.slices()] = 1
    assert (count == inside).all(), seed
