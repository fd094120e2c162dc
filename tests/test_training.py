"""Layout independence: every layout trains to the single-process losses and weights.

One 8-rank torchrun world trains the single-process reference and then every layout
of the matrix in turn (ranks a layout does not use sit idle), so the suite pays the
world's start-up once.
"""

from pathlib import Path

import pytest

from tests.conftest import REPO, TINY, assemble_weights, load_losses, \
    max_relative_difference, run_world

LAYOUTS = REPO / "tests" / "layouts"
REFERENCE_STEPS = 20
UNIFORM = ["dp2-tp2-pp2", "dp1-tp4-pp1", "dp1-tp1-pp4", "dp4-tp1-pp1"]
UNIFORM_STEPS = 10
HETEROGENEOUS = sorted(p.stem for p in LAYOUTS.glob("*.yaml"))
HETERO_STEPS = 20
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("matrix")
    runs = [f"reference=dp1-tp1-pp1:{REFERENCE_STEPS}"]
    runs += [f"{name}={name}:{UNIFORM_STEPS}" for name in UNIFORM]
    runs += [f"{name}={LAYOUTS / name}.yaml:{HETERO_STEPS}" for name in HETEROGENEOUS]
    args = ["--recipe", str(TINY), "--out", str(out)]
    for run in runs:
        args += ["--case", run]
    run_world(8, "tests.workers.train_matrix", args, timeout=900)
    return out


def test_matrix_has_at_least_eight_heterogeneous_layouts():
    assert len(HETEROGENEOUS) >= 8


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", UNIFORM)
def test_uniform_layout_matches_single_process(matrix, name):
    reference = load_losses(matrix / "reference" / "metrics.json")[:UNIFORM_STEPS]
    losses = load_losses(matrix / name / "metrics.json")
    assert max_relative_difference(losses, reference) <= TOLERANCE


@pytest.mark.timeout(900)
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
