"""Layout planner: hardware profiles, cost model, plans, baselines and the CLI."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest
import yaml

from elastor_mcore import cli
from elastor_mcore.cli import plan as plan_command
from elastor_mcore.parallel.layout import load_layout
from elastor_mcore.planner import (CostModel, HardwareError, PlannerError, hardware_from_dict,
                                   layout_cost, load_hardware, plan)
from elastor_mcore.planner.baselines import best_uniform
from elastor_mcore.planner.cost_model import GIB, pipeline_time_s
from elastor_mcore.config.recipe import load_recipe
from tests.test_planner_optimality import (  # THIRDS: six heads, TP 1, 2, 3 or 6
    THIRDS, TIGHT, rejected_unsplit, with_optimizer)

HW_DIR = Path("recipes/hardware")
TINY = load_recipe("recipes/tiny-llama.yaml")
CPU = load_hardware(HW_DIR / "cpu-slots.yaml")
A100 = load_hardware(HW_DIR / "a100-80gb.yaml")
LLAMA2_7B = load_recipe("recipes/llama2-7b.yaml")
LLAMA3_70B = load_recipe("recipes/llama3-70b.yaml")
LLAMA3_8B = load_recipe("recipes/llama3-8b.yaml")


# ----- hardware profiles ----------------------------------------------------------------
@pytest.mark.parametrize("path", sorted(HW_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_profiles_load_and_cite_sources(path):
    hw = load_hardware(path)
    assert hw.name == path.stem and len(hw.source) > 40
    assert 0 < hw.efficiency(1) <= 1


def test_efficiency_interpolates_between_table_entries():
    hw = hardware_from_dict({**_cpu_fields(), "efficiency_by_tp": {2: 0.5, 4: 0.3}})
    assert hw.efficiency(1) == 0.5 and hw.efficiency(8) == 0.3
    assert hw.efficiency(3) == pytest.approx(0.4)


@pytest.mark.parametrize("change,field", [
    ({"efficiency_by_tp": {1: 1.5}}, "efficiency_by_tp"),
    ({"peak_tflops": 0}, "peak_tflops"),
    ({"memory_reserved_gib": 10}, "memory_reserved_gib"),
    ({"nvlink": 5}, "unknown field"),
])
def test_bad_profiles_name_the_field(change, field):
    with pytest.raises(HardwareError, match=field):
        hardware_from_dict({**_cpu_fields(), **change})


def _cpu_fields() -> dict:
    return yaml.safe_load((HW_DIR / "cpu-slots.yaml").read_text())


# ----- cost model -----------------------------------------------------------------------
def test_layer_flops_match_six_times_parameters_per_token():
    cost = CostModel(LLAMA2_7B, A100)
    rate = A100.peak_tflops * 1e12 * A100.efficiency(1)
    flops = cost.layer_compute_s(1) * rate
    tokens = LLAMA2_7B.model.seq_length
    dense = 6 * (cost.layer_params - 2 * LLAMA2_7B.model.hidden_size) * tokens
    assert flops == pytest.approx(dense, rel=0.15)  # plus causal attention
    assert flops > dense


def test_memory_breakdown_of_a_bf16_stage():
    cost = CostModel(LLAMA2_7B, A100)
    mem = cost.stage_memory(tp=4, layers=8, position=1, num_stages=4)  # a middle stage
    params = 8 * ((cost.layer_params - 2 * 4096) / 4 + 2 * 4096)
    assert mem.weights == pytest.approx(2 * params)        # bf16
    assert mem.gradients == pytest.approx(4 * params)      # fp32 main grads
    assert mem.optimizer == pytest.approx(12 * params)     # fp32 master + two moments
    assert mem.reserved == pytest.approx(A100.memory_reserved_gib * GIB)
    # 1F1B keeps (stages - position) micro-batches in flight
    first = cost.stage_memory(tp=4, layers=8, position=0, num_stages=4)
    assert first.activations > mem.activations


def test_zero1_splits_the_optimizer_state_over_the_pipelines():
    assert LLAMA2_7B.training.distributed_optimizer  # as the shipped recipe
    whole = CostModel(with_optimizer(LLAMA2_7B, False), A100).stage_memory(4, 8, 1, 4,
                                                                           replicas=3)
    split = CostModel(LLAMA2_7B, A100).stage_memory(4, 8, 1, 4, replicas=3)
    assert split.optimizer == pytest.approx(whole.optimizer / 3)
    assert (split.weights, split.gradients, split.activations) == \
        (whole.weights, whole.gradients, whole.activations)


def test_zero1_keeps_an_fp32_main_copy_in_fp32_runs_too():
    """The runtime's ZeRO-1 keeps an fp32 main parameter beside the two moments of each
    owned element whatever the dtype: 12 bytes, where the plain fp32 optimizer keeps 8."""
    plain = CostModel(TINY, CPU).stage_memory(1, 2, 0, 1)
    zero = CostModel(with_optimizer(TINY, True), CPU).stage_memory(1, 2, 0, 1, replicas=3)
    assert zero.optimizer == pytest.approx(plain.optimizer * 12 / 8 / 3)


def _training(recipe, **changes):
    return dataclasses.replace(recipe, training=dataclasses.replace(recipe.training, **changes))


def test_overlapped_gradient_reduction_hides_behind_the_backward():
    """``--overlap-grad-reduce`` (Megatron-LM's loop starts the cross-pipeline buckets
    during the last backward) hides the all-reduce behind two thirds of the bottleneck
    stage's time; with ZeRO-1 only the reduce-scatter half, and the all-gather half
    behind a third under ``--overlap-param-gather``; never more than it lasts."""
    pipelines = [(8, [(4, 16), (4, 16)]), (8, [(8, 32)])]
    plain = with_optimizer(LLAMA3_8B, False)
    base = CostModel(plain, A100).step_cost(pipelines, intra_node=False)
    overlapped = CostModel(_training(plain, overlap_grad_reduce=True), A100)
    step = overlapped.step_cost(pipelines, intra_node=False)
    bottleneck = max(base.pipelines, key=lambda p: p.time_s).bottleneck_s
    assert step.grad_sync_s == base.grad_sync_s > 0
    assert step.grad_sync_hidden_s == pytest.approx(min(base.grad_sync_s, 2 * bottleneck / 3))
    assert step.step_s < base.step_s
    zero = _training(LLAMA3_8B, distributed_optimizer=True, overlap_grad_reduce=True)
    half = CostModel(zero, A100).step_cost(pipelines, intra_node=False)
    both = CostModel(_training(zero, overlap_param_gather=True), A100).step_cost(
        pipelines, intra_node=False)
    assert half.grad_sync_hidden_s == pytest.approx(min(half.grad_sync_s / 2, 2 * bottleneck / 3))
    assert both.grad_sync_hidden_s == pytest.approx(
        half.grad_sync_hidden_s + min(half.grad_sync_s / 2, bottleneck / 3))
    assert overlapped.hidden_grad_sync_s(1.0, 30.0) == 1.0


def test_measured_tables_serve_a_recipe_of_their_shape_under_another_name():
    """A recipe translated from Megatron-LM's arguments (named ``megatron-lm``, with
    ``--max-position-embeddings`` set) takes the tables measured on the tiny recipe's
    shape; sequence parallelism, which they were measured without, takes the norms'
    share off each layer's activations at TP > 1."""
    measured = load_hardware(HW_DIR / "cpu-slots-measured.yaml")
    megatron = dataclasses.replace(TINY, name="megatron-lm", model=dataclasses.replace(
        TINY.model, max_position_embeddings=TINY.model.seq_length))
    assert measured.measurements_for(megatron) is measured.measured["tiny-llama"]
    other = dataclasses.replace(megatron, model=dataclasses.replace(megatron.model,
                                                                    vocab_size=1000))
    assert measured.measurements_for(other) is None
    plain = CostModel(megatron, measured).stage_memory(2, 4, 0, 3)
    split = CostModel(_training(megatron, sequence_parallel=True), measured).stage_memory(
        2, 4, 0, 3)
    m = TINY.model
    saving = 3 * 4 * TINY.training.micro_batch_size * m.seq_length * 4 * m.hidden_size / 2 * 4
    assert plain.activations - split.activations == pytest.approx(saving)
    assert CostModel(_training(megatron, sequence_parallel=True), measured).stage_memory(
        1, 4, 0, 3).activations == CostModel(megatron, measured).stage_memory(
        1, 4, 0, 3).activations


def test_a_weight_held_by_three_pipelines_is_split_three_ways():
    """Per stage of a heterogeneous three-pipeline layout, the optimizer state the layout
    gives it: TP-split weights over the 3 pipelines, each norm over every rank holding it
    (the TP ranks of its stage in every pipeline)."""
    recipe = with_optimizer(TINY, True)
    cost = CostModel(recipe, CPU)
    pipelines = [(6, [(2, 5), (1, 3)]), (5, [(1, 8)]), (5, [(1, 2), (4, 6)])]
    step = cost.step_cost(pipelines, intra_node=True)
    h, params = TINY.model.hidden_size, cost.layer_params
    norms = 2 * h                        # per layer: two RMSNorm weights, replicated in TP
    split = params - norms               # the rest of a layer is split by TP

    def expected(tp, layers, holders, first=False, last=False):
        """12 bytes x (split elements / 3 pipelines + norm elements / their holders)."""
        vocab = cost.recipe.model.padded_vocab_size * h / tp
        sharded = layers * split / tp + vocab * (first + last)
        final = h / (1 + 1 + 4) if last else 0  # the last stages: TP 1, 1 and 4
        replicated = sum(norms / r for r in holders) + final
        return 12 * (sharded / 3 + replicated)

    # layers 0-4 of P0 (TP 2): held by P0's 2 ranks, P1's 1, P2's 1 (layers 0-1) or 4
    assert step.pipelines[0].stages[0].memory.optimizer == pytest.approx(
        expected(2, 5, [2 + 1 + 1] * 2 + [2 + 1 + 4] * 3, first=True))
    assert step.pipelines[0].stages[1].memory.optimizer == pytest.approx(
        expected(1, 3, [1 + 1 + 4] * 3, last=True))
    assert step.pipelines[1].stages[0].memory.optimizer == pytest.approx(
        expected(1, 8, [2 + 1 + 1] * 2 + [2 + 1 + 4] * 3 + [1 + 1 + 4] * 3,
                 first=True, last=True))
    assert step.pipelines[2].stages[1].memory.optimizer == pytest.approx(
        expected(4, 6, [2 + 1 + 4] * 3 + [1 + 1 + 4] * 3, last=True))
    # the search charges each norm over the pipelines only: at least what the layout gives
    search = cost.stage_memory(4, 6, 1, 2, replicas=3)
    assert search.optimizer > step.pipelines[2].stages[1].memory.optimizer
    vocab = cost.recipe.model.padded_vocab_size * h / 4
    assert search.optimizer == pytest.approx(12 * (6 * split / 4 + vocab + 6 * norms + h) / 3)


def test_communication_volumes():
    cost = CostModel(LLAMA2_7B, A100, sequence_parallel=False)
    message = 4096 * 4096 * 2  # one bf16 micro-batch of hidden states
    middle = cost.stage_cost(tp=4, layers=8, position=1, num_stages=3, intra_node=False)
    assert middle.p2p_bytes == 2 * message
    sp = CostModel(LLAMA2_7B, A100, sequence_parallel=True)
    rows = sp.stage_cost(tp=4, layers=8, position=1, num_stages=3, intra_node=False)
    assert rows.p2p_bytes == 2 * message / 4  # each rank sends its quarter of the rows
    assert rows.p2p_s < middle.p2p_s
    assert middle.tp_comm_bytes == pytest.approx(8 * 4 * 2 * 3 / 4 * message)
    alone = cost.stage_cost(tp=1, layers=32, position=0, num_stages=1, intra_node=True)
    assert alone.p2p_bytes == 0 and alone.tp_comm_bytes == 0 and alone.p2p_s == 0


def test_pipeline_time_has_the_1f1b_bubble():
    assert pipeline_time_s(micro_batches=8, num_stages=4, bottleneck_s=1.0) == 11.0


def test_measured_table_replaces_the_layer_time():
    hw = hardware_from_dict({**_cpu_fields(), "measured_layer_ms": {"tiny-llama": {1: 7.5}}})
    cost = CostModel(TINY, hw)
    assert cost.layer_time_s(1) == pytest.approx(7.5e-3)
    assert cost.layer_time_s(2) == CostModel(TINY, CPU).layer_time_s(2)


def test_layout_cost_matches_planner_prediction():
    result = plan(TINY, CPU, range(8))
    again = layout_cost(CostModel(TINY, CPU), result.layout, CPU.gpus_per_node)
    assert again.step_s == pytest.approx(result.step_s)


# ----- plans ----------------------------------------------------------------------------
@pytest.mark.parametrize("dead", [[], [3], [3, 5]])
def test_tiny_plan_uses_every_alive_slot(dead):
    alive = [g for g in range(8) if g not in dead]
    result = plan(TINY, CPU, alive)
    result.layout.validate(TINY)
    assert sorted(result.layout.ranks) == alive  # physical slot ids, all of them
    if len(alive) == 7:
        assert not result.layout.is_uniform


def test_more_slots_plan_faster():
    times = [plan(TINY, CPU, range(n)).step_s for n in (4, 6, 8)]
    assert times[0] > times[1] > times[2]


def test_plans_are_deterministic():
    a = plan(LLAMA2_7B, A100, [g for g in range(32) if g not in (0, 9)])
    b = plan(LLAMA2_7B, A100, [g for g in range(32) if g not in (9, 0)])
    assert a.layout == b.layout


def test_tp_groups_stay_inside_nodes_and_respect_the_restriction():
    result = plan(LLAMA2_7B, A100, [g for g in range(32) if g not in (0, 9, 18)],
                  tp_sizes=[2, 4, 8])
    for _, _, stage in result.layout.iter_stages():
        assert stage.tp in (2, 4, 8)
        assert len({r // 8 for r in stage.ranks}) == 1


def test_tp_groups_of_any_size_that_divides_the_model():
    hw = hardware_from_dict({**TIGHT, "memory_per_gpu_gib": 0.12})
    ours = plan(THIRDS, hw, range(6), gpus_per_node=8)
    pow2 = plan(THIRDS, hw, range(6), gpus_per_node=8, tp_sizes=[1, 2, 4, 8])
    assert {s.tp for _, _, s in ours.layout.iter_stages()} == {3}
    assert ours.step_s < pow2.step_s


@pytest.mark.parametrize("recipe,nodes", [(LLAMA2_7B, 4), (LLAMA3_70B, 32)])
def test_planner_is_never_worse_than_uniform_megatron(recipe, nodes):
    for dead in ([], [0], [0, 9, 18]):
        alive = [g for g in range(nodes * 8) if g not in dead]
        ours, uniform = plan(recipe, A100, alive), best_uniform(recipe, A100, alive)
        assert ours.step_s <= uniform.step_s * (1 + 1e-9)
        assert uniform.layout.is_uniform
        for result in (ours, uniform):
            assert all(stage.memory.total <= A100.memory_per_gpu_gib * GIB
                       for pipe in result.cost.pipelines for stage in pipe.stages)


def test_plans_1024_gpus_quickly():
    alive = [g for g in range(1024) if g not in (0, 9, 100, 513)]
    start = time.process_time()
    result = plan(LLAMA3_70B, load_hardware(HW_DIR / "h100-80gb.yaml"), alive)
    assert time.process_time() - start < 5  # the benchmark holds it to 1 s
    result.layout.validate(LLAMA3_70B)
    assert result.layout.num_gpus > 900


@pytest.mark.parametrize("dead", [[], [0, 9, 18, 27]], ids=["all alive", "one dead per node"])
def test_counting_zero1_admits_a_faster_llama3_8b_layout(dead):
    """Llama-3 8B on 4 x 8 A100-80GB with the distributed optimizer (docs/planner.md):
    with the optimizer state split over the pipelines the search finds a faster layout
    than with all of it charged to every rank (the upper bound it used before), one the
    upper bound rejects for memory."""
    alive = [g for g in range(32) if g not in dead]
    sharded = plan(LLAMA3_8B, A100, alive)
    upper = plan(with_optimizer(LLAMA3_8B, False), A100, alive)  # bf16: 12 B/param either way
    assert sharded.layout != upper.layout
    assert sharded.step_s < upper.step_s * (1 - 1e-3)
    capacity = A100.memory_per_gpu_gib * GIB
    unsplit = CostModel(LLAMA3_8B, A100)
    assert rejected_unsplit(unsplit, sharded.layout, capacity)
    assert all(stage.memory.total <= capacity
               for pipe in sharded.cost.pipelines for stage in pipe.stages)
    # the upper bound's layout costs the same time either way (no optimizer-step table)
    again = layout_cost(unsplit, upper.layout, 8)
    assert again.step_s == pytest.approx(upper.step_s)


def test_infeasible_cluster_says_how_much_memory_is_missing():
    with pytest.raises(PlannerError, match=r"GiB are missing"):
        plan(LLAMA3_70B, A100, range(8))


def test_bad_tp_restriction_is_an_error():
    with pytest.raises(PlannerError, match="tp_sizes"):
        plan(TINY, CPU, range(8), tp_sizes=[3])


# ----- CLI ------------------------------------------------------------------------------
def cli_main(argv: list[str]) -> int:
    """``elastor plan`` alone: the full CLI imports every sub-command (torch, mcore)."""
    import argparse

    parser = argparse.ArgumentParser(prog="elastor")
    plan_command.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_elastor_plan_runs_through_the_real_entry_point_with_shipped_names(capsys):
    """The ``elastor`` console script's own ``main``, with a recipe and a hardware
    profile named as they ship (no paths): what a user of the wheel types."""
    assert cli.main(["plan", "--recipe", "tiny-llama", "--hardware", "cpu-slots",
                     "--nodes", "2", "--dead", "3"]) == 0
    assert "predicted step time" in capsys.readouterr().out


def test_cli_prints_a_diagram_and_writes_the_layout(tmp_path, capsys):
    out = tmp_path / "layout.yaml"
    code = cli_main(["plan", "--recipe", "recipes/tiny-llama.yaml", "--hardware",
                     str(HW_DIR / "cpu-slots.yaml"), "--nodes", "2", "--dead", "3",
                     "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    assert "pipeline" in text and "stage 0" in text and "predicted step time" in text
    assert "of all GPUs alive" in text
    layout = load_layout(out, TINY)
    assert 3 not in layout.ranks and layout.num_gpus == 7


def test_cli_says_what_it_assumed_of_the_optimizer_and_shows_its_sharded_bytes(capsys):
    args = ["plan", "--recipe", "recipes/llama3-8b.yaml", "--hardware",
            str(HW_DIR / "a100-80gb.yaml"), "--nodes", "4", "--dead", "0,9,18,27"]
    assert cli_main(args) == 0
    text = capsys.readouterr().out
    result = plan(LLAMA3_8B, A100, [g for g in range(32) if g not in (0, 9, 18, 27)])
    pipes = len(result.layout.pipelines)
    assert (f"distributed optimizer on (training.distributed_optimizer: each weight's "
            f"optimizer state split over the {pipes} pipeline(s)") in text
    optimizer = result.cost.pipelines[0].stages[0].memory.optimizer
    assert f"(optimizer {optimizer / GIB:6.1f} GiB)" in text
    assert cli_main(args + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["distributed_optimizer"] is True
    assert report["stages"][0]["memory_gib"]["optimizer"] == pytest.approx(optimizer / GIB)
    # without it, every rank holds all its weights' state
    assert cli_main(["plan", "--recipe", "recipes/tiny-llama.yaml", "--hardware",
                     str(HW_DIR / "cpu-slots.yaml"), "--nodes", "1"]) == 0
    assert "distributed optimizer off" in capsys.readouterr().out


def test_cli_json_report(capsys):
    code = cli_main(["plan", "--recipe", "recipes/llama2-7b.yaml", "--hardware",
                     str(HW_DIR / "a100-80gb.yaml"), "--nodes", "4", "--gpus-per-node", "8",
                     "--dead", "0,9", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert report["gpus_used"] <= 30 and 0 < report["relative_throughput"] < 1
    assert {"memory_gib", "time_s", "gpus"} <= set(report["stages"][0])


@pytest.mark.parametrize("args,message", [
    (["--dead", "99"], "outside"),
    (["--dead", "x"], "comma-separated"),
    (["--nodes", "0"], "positive"),
])
def test_cli_rejects_bad_input(args, message, capsys):
    base = ["plan", "--recipe", "recipes/tiny-llama.yaml", "--hardware",
            str(HW_DIR / "cpu-slots.yaml"), "--nodes", "2"]
    assert cli_main(base + args) == 2
    assert message in capsys.readouterr().err
