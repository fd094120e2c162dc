"""Layouts: YAML parsing, rank assignment, validation messages, and Megatron's groups."""

import pytest
import yaml

from elastor_mcore.parallel.groups import replica_ranks, stage_chains
from elastor_mcore.parallel.layout import LayoutError, layout_from_dict, load_layout
from elastor_mcore.config.recipe import load_recipe
from tests.conftest import TINY

RECIPE = load_recipe(TINY)


def write(tmp_path, data) -> str:
    path = tmp_path / "layout.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def two_stage(tp0=2, tp1=2, layers=(4, 4), mb=16):
    return {"pipelines": [{"micro_batches": mb, "stages": [
        {"tp": tp0, "layers": layers[0]}, {"tp": tp1, "layers": layers[1]}]}]}


def test_ranks_are_assigned_pipeline_major_then_stage_then_tp():
    layout = layout_from_dict({"pipelines": [
        {"micro_batches": 8, "stages": [{"tp": 2, "layers": 3}, {"tp": 1, "layers": 5}]},
        {"micro_batches": 8, "stages": [{"tp": 4, "layers": 8}]}]})
    assert [s.ranks for _, _, s in layout.iter_stages()] == [(0, 1), (2,), (3, 4, 5, 6)]
    assert layout.position(4).pipeline == 1 and layout.position(4).tp_rank == 1


def test_explicit_ranks_are_skipped_by_automatic_assignment():
    layout = layout_from_dict({"pipelines": [{"micro_batches": 16, "stages": [
        {"tp": 2, "layers": 4}, {"tp": 1, "layers": 4, "ranks": [0]}]}]})
    assert [s.ranks for _, _, s in layout.iter_stages()] == [(1, 2), (0,)]


def test_idle_ranks_and_world_size():
    layout = layout_from_dict({"pipelines": [{"micro_batches": 16, "stages": [
        {"tp": 2, "layers": 4, "ranks": [0, 1]}, {"tp": 1, "layers": 4, "ranks": [3]}]}]})
    assert layout.world_size == 4 and layout.num_gpus == 3 and layout.position(2) is None


def test_yaml_round_trip(tmp_path):
    layout = load_layout("dp2-tp2-pp2", RECIPE)
    again = load_layout(write(tmp_path, yaml.safe_load(layout.to_yaml())), RECIPE)
    assert again == layout


@pytest.mark.parametrize("data, message", [
    (two_stage(layers=(4, 3)), "pipelines[0]: stage layers sum to 7"),
    (two_stage(mb=12), "micro_batches sum to 12"),
    (two_stage(tp0=3), "pipelines[0].stages[0].tp=3 does not divide num_attention_heads=8"),
    (two_stage(tp1=8), "pipelines[0].stages[1].tp=8 does not divide num_query_groups=4"),
    ({"pipelines": [{"micro_batches": 16, "stages": [
        {"tp": 1, "layers": 4, "ranks": [0]}, {"tp": 1, "layers": 4, "ranks": [0]}]}]},
     "rank 0 is also used by pipelines[0].stages[0]"),
    ({"pipelines": [{"micro_batches": 16, "stages": [{"tp": 2, "layers": 8, "ranks": [0]}]}]},
     "ranks must list exactly tp=2 ranks"),
    ({"pipelines": [{"micro_batches": 16, "stages": [{"tp": 0, "layers": 8}]}]},
     "pipelines[0].stages[0].tp must be a positive integer"),
    ({"pipelines": []}, "non-empty 'pipelines'"),
    ({"pipelines": [{"micro_batches": 16, "stages": [{"tp": 1, "layer": 8}]}]},
     "unknown field(s) ['layer']"),
])
def test_invalid_layouts_name_the_problem(tmp_path, data, message):
    with pytest.raises(LayoutError) as err:
        load_layout(write(tmp_path, data), RECIPE)
    assert message in str(err.value)


@pytest.mark.parametrize("spec, message", [
    ("dp3-tp1-pp1", "dp=3 does not divide the 16 micro-batches"),
    ("dp1-tp1-pp3", "pp=3 does not divide num_layers=8"),
    ("dp1-tp3-pp1", "tp=3 does not divide"),
    ("nonexistent.yaml", "neither a shorthand"),
])
def test_invalid_shorthands_name_the_problem(spec, message):
    with pytest.raises(LayoutError) as err:
        load_layout(spec, RECIPE)
    assert message in str(err.value)


@pytest.mark.parametrize("dp, tp, pp", [(2, 2, 2), (1, 4, 1), (1, 1, 4), (4, 1, 1), (2, 1, 4)])
def test_uniform_groups_equal_megatron_groups(dp, tp, pp):
    """Our TP, PP (stage chain) and DP rank sets are mcore's, from the same rank
    generator ``initialize_model_parallel`` uses for the default order."""
    from megatron.core.parallel_state import RankGenerator

    layout = load_layout(f"dp{dp}-tp{tp}-pp{pp}", RECIPE)
    mcore = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    ours_tp = sorted(list(s.ranks) for _, _, s in layout.iter_stages())
    ours_pp = sorted(c for p in range(dp) for c in stage_chains(layout, p))
    ours_dp = sorted({tuple(replica_ranks(layout, r)) for r in layout.ranks})
    assert ours_tp == sorted(mcore.get_ranks("tp"))
    assert ours_pp == sorted(mcore.get_ranks("pp"))
    assert [list(g) for g in ours_dp] == sorted(mcore.get_ranks("dp"))


def test_stage_ranks_follow_the_group_order_torch_gives():
    """torch orders a group by global rank and mcore takes the TP rank from the group:
    a stage listed as [5, 1] has TP rank 0 on rank 1, and the layout says so too."""
    layout = layout_from_dict({"pipelines": [{"micro_batches": 16, "stages": [
        {"tp": 2, "layers": 8, "ranks": [5, 1]}]}]})
    assert layout.pipelines[0].stages[0].ranks == (1, 5)
    assert layout.position(1).tp_rank == 0 and layout.position(5).tp_rank == 1
    assert layout.to_dict()["pipelines"][0]["stages"][0]["ranks"] == [1, 5]
