"""Installing a layout's groups leaves no ``parallel_state`` global missing.

``groups.install`` sets every global the installed Megatron-Core defines (the list is
read from the module by ``compat.mcore``), so every getter must answer, on mcore 0.16
and 0.19 alike. One 4-rank gloo world (``tests/workers/parallel_state.py``, in the world
of ``test_checkpoint_mcore``: conftest ``mcore_world``) calls every
``get_*`` / ``is_*`` function of ``parallel_state`` with every combination of its
boolean keyword arguments, after installing a heterogeneous TP2 | TP1 | TP1 pipeline,
and compares against mcore's own ``initialize_model_parallel`` on two uniform layouts.

Exclusions, and why:

* ``get_nccl_options``: looks up NCCL options by group name; not state.
* ``get_global_symmetric_memory_buffer`` (0.16): an inference buffer on CUDA symmetric
  memory, created on demand; mcore's ``initialize_model_parallel`` leaves it unset too.
* ``partial_data_parallel=True`` without ``with_context_parallel=True``: mcore rejects
  the combination by contract ("Partial DP for Optimizer needs to include CP").

Expert/MoE, context-parallel and GTP-remat getters are not excluded: with EP = CP =
GTP = 1 they answer with the rank's own singleton group (size 1, rank 0), and expert
TP / expert DP with the dense TP / DP groups, as ``initialize_model_parallel`` does.
"""

from __future__ import annotations

import json

import pytest



@pytest.fixture(scope="module")
def world(mcore_world):
    """The checks' reports, from the world shared with ``test_checkpoint_mcore``."""
    return json.loads((mcore_world / "parallel_state" / "result.json").read_text())


@pytest.mark.timeout(240)
def test_every_getter_answers_under_a_heterogeneous_layout(world):
    for report in world["ranks"]:
        assert report["calls"] > 60, report
        assert report["hetero"] == [], f"rank {report['rank']}: " + "\n".join(report["hetero"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("spec", ["dp2-tp1-pp2", "dp1-tp2-pp2"])
def test_uniform_install_answers_like_initialize_model_parallel(world, spec):
    for report in world["ranks"]:
        assert report[spec] == [], f"rank {report['rank']}: " + "\n".join(report[spec])


def test_every_global_of_parallel_state_is_classified():
    """Each ``_UPPER_CASE`` global of the installed ``parallel_state`` gets a value (no
    world needed: the classification is by name)."""
    from elastor_mcore.compat.mcore import (
        Axis, RankAxes, global_values, parallel_state_globals)

    a = Axis(object(), [0])
    axes = RankAxes(rank=0, tp=a, pp=a, dp=a, model=a, tp_dp=a, active=a, single=a,
                    stage=0, num_stages=1, tp_rank=0, dp_rank=0)
    names = parallel_state_globals()
    values = global_values(axes, names)
    buffers = {n for n in names if n.endswith("MEMORY_BUFFER")}
    assert set(values) == set(names) - buffers
    assert any(n.endswith("_GROUP") for n in values) and any(n.startswith("_MPU_") for n in values)
