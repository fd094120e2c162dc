"""Layout independence: every layout trains to the single-process losses and weights,
and a checkpoint saved under one layout loads bit-exact under any other.

The matrix runs in the 8-rank world the layout-training modules share
(``tests/train_world.py``; ranks a layout does not use sit idle):

* the single-process reference (4 steps) and four uniform layouts (2 steps);
* eight heterogeneous layouts (4 steps), four of them saving their final state;
* resharding: five (save layout, load layout) pairs (uniform -> heterogeneous,
  heterogeneous -> one process, heterogeneous -> heterogeneous twice, heterogeneous ->
  data-parallel replicas, whose classes share their reads), each loading one
  of those checkpoints under another layout and comparing every local shard, Adam
  moments included, byte for byte with the tensors the saving ranks held (their own
  ``torch.save`` copies, not a read of the checkpoint);
* resume: 2 steps under one layout, saved, then 2 more under another (the loaded Adam
  moments shape the first resumed update, which the last loss sees).

Four steps are enough to catch a wrong layout: one AdamW step moves the loss by ~1e-3
relative, a hundred times the tolerance, so a gradient lost or counted twice in any of
the first three steps fails the loss comparison, and in the last the weights' (compared
after it). Each step of a TP-4 layout costs seconds here, so the world trains no more.
"""

from pathlib import Path

import pytest
import torch

from elastor_mcore.config.recipe import load_recipe
from elastor_mcore.parallel.layout import load_layout
from tests.conftest import LAYOUTS, assemble_weights, layout_arg, load_losses, \
    max_relative_difference
from tests.train_world import TIMEOUT, TrainWorldPart

REFERENCE_STEPS = 4
UNIFORM = ["dp2-tp2-pp2", "dp1-tp4-pp1", "dp1-tp1-pp4", "dp4-tp1-pp1"]
UNIFORM_STEPS = 2
HETEROGENEOUS = sorted(p.stem for p in LAYOUTS.glob("*.yaml"))
HETERO_STEPS = 4
TOLERANCE = 1e-5
RESHARD_PAIRS = [  # (saved by, loaded under): uniform <-> hetero, hetero <-> hetero
    ("dp2-tp2-pp2", "tp4-tp2-tp1"),
    ("tp4-tp2-tp1", "dp1-tp1-pp1"),
    ("two-pipelines-different-stages", "unequal-micro-batches"),
    ("three-pipelines-uneven", "tp1-to-tp4"),
    # data-parallel replicas: the trainer's load shares each replica class's reads
    ("two-pipelines-different-stages", "dp2-tp2-pp2"),
]
RESUME = ("unequal-micro-batches", "three-pipelines-uneven", 2)


def train_world_part(out: Path) -> TrainWorldPart:
    ckpt = out / "checkpoints"
    savers = {a for a, _ in RESHARD_PAIRS}
    cases = [f"reference=dp1-tp1-pp1:{REFERENCE_STEPS}"]
    steps = {**{n: UNIFORM_STEPS for n in UNIFORM}, **{n: HETERO_STEPS for n in HETEROGENEOUS}}
    for name in UNIFORM + HETEROGENEOUS:
        save = f",save={ckpt / name}" if name in savers else ""
        cases.append(f"{name}={layout_arg(name)}:{steps[name]}{save}")
    # Loaded at the saved step and not trained further: the check is the load itself.
    cases += [f"reshard-{a}-to-{b}={layout_arg(b)}:{steps[a]},load={ckpt / a},verify"
              for a, b in RESHARD_PAIRS]
    first, second, at = RESUME
    cases += [f"resume-first={layout_arg(first)}:{at},save={ckpt / 'resume'}",
              f"resume-second={layout_arg(second)}:{REFERENCE_STEPS},load={ckpt / 'resume'}"]
    return TrainWorldPart(cases)


@pytest.fixture(scope="module")
def matrix(train_world) -> Path:
    return train_world[__name__]


def test_matrix_has_at_least_eight_heterogeneous_layouts():
    """The layout files themselves, not their names: each is valid for the tiny recipe
    and is one stock Megatron could not train."""
    recipe = load_recipe("tiny-llama")
    truly = [n for n in HETEROGENEOUS if not load_layout(LAYOUTS / f"{n}.yaml", recipe).is_uniform]
    assert len(truly) >= 8, f"only {truly} of {HETEROGENEOUS} are heterogeneous"


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("name", UNIFORM)
def test_uniform_layout_matches_single_process(matrix, name):
    reference = load_losses(matrix / "reference" / "metrics.json")
    losses = load_losses(matrix / name / "metrics.json")
    assert len(losses) >= UNIFORM_STEPS
    assert max_relative_difference(losses, reference[:len(losses)]) <= TOLERANCE


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("name", HETEROGENEOUS)
def test_heterogeneous_layout_matches_single_process(matrix, name):
    reference = load_losses(matrix / "reference" / "metrics.json")
    losses = load_losses(matrix / name / "metrics.json")
    assert len(losses) == HETERO_STEPS
    assert max_relative_difference(losses, reference) <= TOLERANCE

    expected = assemble_weights(matrix / "reference")
    weights = assemble_weights(matrix / name)
    assert weights.keys() == expected.keys()
    for key, ref in expected.items():
        got = weights[key]
        assert not got.isnan().any(), f"{key} is not fully covered by the layout's shards"
        diff = (got - ref).abs().max() / ref.abs().max()
        assert diff <= TOLERANCE, f"{key}: relative difference {diff:.2e}"


def saved_state(directory: Path) -> dict[str, torch.Tensor]:
    """The global tensors (weights and Adam moments) the saving ranks held, rebuilt from
    their ``torch.save`` copies (train_matrix.py), checking every element is covered."""
    full: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("rank*.pt")):
        for key, shape, offset, tensor in torch.load(f):
            if key not in full:
                full[key] = torch.zeros(shape, dtype=tensor.dtype)
                covered[key] = torch.zeros(shape, dtype=torch.bool)
            box = tuple(slice(o, o + n) for o, n in zip(offset, tensor.shape))
            if covered[key][box].any():   # a replica (data parallel) holds the same values
                assert torch.equal(full[key][box], tensor), f"{key}: replicas differ"
            full[key][box], covered[key][box] = tensor, True
    for key, mask in covered.items():
        assert mask.all(), f"{key}: not every element was saved by some rank"
    return full


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("saved, loaded", RESHARD_PAIRS)
def test_reshard_loads_every_shard_bit_exact(matrix, saved, loaded):
    """Each shard loaded under another layout equals, byte for byte, its slice of what the
    saving ranks held: compared with their own copies, not with a read of the checkpoint,
    which would share the loader's read path."""
    expected = saved_state(matrix / "checkpoints" / f"{saved}.state")
    assert any(k.startswith("optimizer.exp_avg_sq.") for k in expected)
    rank_files = sorted((matrix / f"reshard-{saved}-to-{loaded}").glob("loaded.rank*.pt"))
    assert rank_files
    loaded_keys, covered = set(), {k: torch.zeros_like(t, dtype=torch.bool)
                                   for k, t in expected.items()}
    for f in rank_files:
        for key, shape, offset, tensor in torch.load(f):
            assert key in expected, f"{f.name}: {key} was not saved"
            assert tuple(shape) == tuple(expected[key].shape), key
            box = tuple(slice(o, o + n) for o, n in zip(offset, tensor.shape))
            want = expected[key][box]
            assert tensor.dtype == want.dtype, key
            assert torch.equal(tensor, want), f"{f.name}: {key} at {offset} differs after load"
            loaded_keys.add(key)
            covered[key][box] = True
    assert loaded_keys == set(expected)
    for key, mask in covered.items():
        assert mask.all(), f"{key}: part of it is held by no rank after the load"


@pytest.mark.timeout(TIMEOUT)
def test_resume_under_another_layout_matches_uninterrupted(matrix):
    _, _, at = RESUME
    reference = load_losses(matrix / "reference" / "metrics.json")
    first = load_losses(matrix / "resume-first" / "metrics.json")
    second = load_losses(matrix / "resume-second" / "metrics.json")
    assert len(first) == at and len(second) == REFERENCE_STEPS - at
    assert max_relative_difference(first + second, reference) <= TOLERANCE
