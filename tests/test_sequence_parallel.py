"""Sequence-parallel stage boundaries as data, and the settings' errors (no processes).

The training runs (SP and recomputation against one process) share the randomized
layouts' world: ``tests/test_random_layouts.py``.
"""

from fractions import Fraction

import pytest

from elastor_mcore.config.recipe import RecipeError, recipe_from_dict
from elastor_mcore.config.yaml_file import read_yaml_file
from elastor_mcore.parallel.layout import LayoutError, layout_from_dict, load_layout
from elastor_mcore.runtime.p2p import WHOLE, stage_links
from tests.conftest import TINY, layout_arg
from tests.test_random_layouts import random_layout

LINK_SEEDS = [11, 12, 13, 14, 15, 16]


def tiny(**training):
    data = read_yaml_file(TINY, "recipe", RecipeError)
    data["training"].update(training)
    return recipe_from_dict(data)


def covered(transfers) -> list[tuple[Fraction, Fraction]]:
    return sorted(t.rows for t in transfers)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["replicated", "sp"])
@pytest.mark.parametrize("seed", LINK_SEEDS, ids=[f"seed{s}" for s in LINK_SEEDS])
def test_every_rank_receives_exactly_its_rows_once(seed, sequence_parallel):
    layout = layout_from_dict(random_layout(seed))
    links = {r: stage_links(layout, r, sequence_parallel) for r in layout.ranks}
    for rank, mine in links.items():
        for direction, receives in (("forward", mine.recv_forward),
                                    ("backward", mine.recv_backward)):
            if not receives:
                continue
            rows = covered(receives)
            assert rows[0][0] == mine.rows[0] and rows[-1][1] == mine.rows[1]
            assert all(a[1] == b[0] for a, b in zip(rows, rows[1:]))  # tiles, no overlap
            for t in receives:  # the sender sends exactly this piece to this rank
                sends = links[t.peer].send_forward if direction == "forward" \
                    else links[t.peer].send_backward
                assert [s.rows for s in sends if s.peer == rank] == [t.rows]
                assert links[t.peer].rows[0] <= t.rows[0] and t.rows[1] <= links[t.peer].rows[1]
        for direction, sends in (("forward", mine.send_forward),
                                 ("backward", mine.send_backward)):
            for t in sends:
                receives = links[t.peer].recv_forward if direction == "forward" \
                    else links[t.peer].recv_backward
                assert any(r.peer == rank and r.rows == t.rows for r in receives)
        if not sequence_parallel:
            assert mine.rows == WHOLE
            assert all(len(r) <= 1 for r in (mine.recv_forward, mine.recv_backward))


def test_tp4_to_tp2_to_tp1_resplits_the_sequence():
    layout = load_layout(layout_arg("tp4-tp2-tp1"), tiny(sequence_parallel=True))
    stage0, stage1, stage2 = layout.pipelines[0].stages
    quarter, half = Fraction(1, 4), Fraction(1, 2)
    second = stage_links(layout, stage1.ranks[1], True)
    assert second.rows == (half, 1)
    assert [(t.peer, t.rows) for t in second.recv_forward] == [
        (stage0.ranks[2], (half, 3 * quarter)), (stage0.ranks[3], (3 * quarter, 1))]
    last = stage_links(layout, stage2.ranks[0], True)
    assert [(t.peer, t.rows) for t in last.send_backward] == [
        (stage1.ranks[0], (0, half)), (stage1.ranks[1], (half, 1))]


def test_sequence_parallel_needs_seq_length_divisible_by_each_tp():
    data = read_yaml_file(TINY, "recipe", RecipeError)
    data["model"]["seq_length"] = 30
    data["training"]["sequence_parallel"] = True
    with pytest.raises(LayoutError, match=r"pipelines\[0\].stages\[0\].tp=4 does not divide "
                                          r"model.seq_length=30.*sequence_parallel: false"):
        load_layout(layout_arg("tp4-tp2-tp1"), recipe_from_dict(data))


def test_uniform_recompute_chunks_must_divide_every_stage():
    recipe = tiny(recompute_granularity="full", recompute_method="uniform",
                  recompute_num_layers=2)
    with pytest.raises(LayoutError, match=r"pipelines\[0\].stages\[1\].layers=3 is not a "
                                          r"multiple of training.recompute_num_layers=2"):
        load_layout(layout_arg("tp4-tp2-tp1"), recipe)


@pytest.mark.parametrize("settings, message", [
    ({"recompute_granularity": "some"}, "use 'full', 'selective'"),
    ({"recompute_granularity": "full", "recompute_num_layers": 1}, "needs training.recompute_method"),
    ({"recompute_granularity": "full", "recompute_method": "block"},
     "needs training.recompute_num_layers"),
    ({"recompute_granularity": "selective", "recompute_num_layers": 2},
     "go with training.recompute_granularity='full'"),
    ({"sequence_parallel": "yes"}, "use true or false"),
])
def test_bad_settings_name_the_field(settings, message):
    with pytest.raises(RecipeError, match=message):
        tiny(**settings)


# ----------------------------------------------------------------- the planner's model

A100 = "recipes/hardware/a100-80gb.yaml"
FULL_UNIFORM = {"recompute_granularity": "full", "recompute_method": "uniform",
                "recompute_num_layers": 1}


def cost_model(**training):
    from elastor_mcore.planner import CostModel, load_hardware

    return CostModel(tiny(**training), load_hardware(A100))


def test_planner_follows_the_recipes_sequence_parallelism():
    off, on = cost_model(), cost_model(sequence_parallel=True)
    assert not off.sequence_parallel and on.sequence_parallel
    assert on.stage_memory(4, 2, 0, 2).activations < off.stage_memory(4, 2, 0, 2).activations
    assert on.stage_memory(1, 2, 0, 2).activations == off.stage_memory(1, 2, 0, 2).activations
    assert on.layer_time_s(4) == off.layer_time_s(4)  # all-gather + reduce-scatter: same volume


def test_planner_accounts_for_recomputation():
    plain, full = cost_model(), cost_model(**FULL_UNIFORM)
    selective = cost_model(recompute_granularity="selective")
    block = cost_model(recompute_granularity="full", recompute_method="block",
                       recompute_num_layers=2)
    assert full.layer_time_s(2) == pytest.approx(plain.layer_time_s(2) * 4 / 3)
    assert selective.layer_time_s(2) > plain.layer_time_s(2)
    assert block.stage_cost(2, 5, 0, 2, True).compute_s == pytest.approx(
        plain.stage_cost(2, 5, 0, 2, True).compute_s + 2 * plain.layer_time_s(2) / 3)
    memory = {name: m.stage_memory(2, 5, 0, 2).activations
              for name, m in (("plain", plain), ("full", full), ("block", block),
                              ("selective", selective))}
    assert memory["full"] < memory["block"] < memory["plain"] == memory["selective"]
    assert full.layer_memory_bytes(2, 0, 2) < plain.layer_memory_bytes(2, 0, 2)


def test_elastor_plan_states_what_it_assumed(tmp_path, capsys):
    from elastor_mcore.cli import main
    from tests.conftest import write_tiny_recipe

    recipe = write_tiny_recipe(tmp_path / "r.yaml", sequence_parallel=True, **FULL_UNIFORM)
    assert main(["plan", "--recipe", str(recipe), "--hardware", A100, "--nodes", "1"]) == 0
    assert ("assumed: sequence parallelism on (training.sequence_parallel), activation "
            "recomputation full (uniform, 1 layer(s))") in capsys.readouterr().out
