"""``elastor demo``'s slots show per-stage TP (issue 16 point 5): their memory
(``recipes/hardware/cpu-slots-2.25mib.yaml``) holds tiny-llama on no pipeline of TP-1
stages alone, so once a node has lost a slot (three left there, one of them a TP-1
group) the planner puts TP 2 and TP 1 stages in one pipeline. Planner only, on the
demo's own defaults: the demo itself runs for minutes (README, docs/elastic.md)."""

from __future__ import annotations

import socket

import pytest
import yaml

from elastor_mcore.cli import build_parser
from elastor_mcore.cli.demo import DEFAULT_HARDWARE, mixed_tp, slot_bytes
from elastor_mcore.config.recipe import load_recipe
from elastor_mcore.elastic.profiling import CACHED_NAME, choose_profile
from elastor_mcore.planner import PlannerError, load_hardware, plan

DEMO = build_parser().parse_args(["demo"])
RECIPE = load_recipe(DEMO.recipe)
HARDWARE = load_hardware(DEMO.hardware)
KILLED, HUNG = (int(spec.split(":")[1]) for spec in (DEMO.kill, DEMO.hang))
LAUNCHES = {"launch 0": (), "launch 1 (after the kill)": (KILLED,),
            "launch 2 (after the hang)": (KILLED, HUNG)}


def alive(dead: tuple[int, ...]) -> list[int]:
    return [s for s in range(DEMO.slots) if s not in dead]


def test_the_demo_plans_with_its_memory_limited_profile():
    assert DEMO.hardware == str(DEFAULT_HARDWARE)
    assert slot_bytes(HARDWARE) == 2.25 * 2**20
    assert HARDWARE.measurements_for(RECIPE) is not None  # measured memory per layer


@pytest.mark.parametrize("dead", LAUNCHES.values(), ids=LAUNCHES.keys())
def test_tp1_stages_alone_cannot_hold_the_model(dead):
    with pytest.raises(PlannerError, match="no layout|does not fit"):
        plan(RECIPE, HARDWARE, alive(dead), tp_sizes=[1])


@pytest.mark.parametrize("dead", list(LAUNCHES.values())[1:], ids=list(LAUNCHES)[1:])
def test_after_a_failure_one_pipeline_mixes_tp_degrees(dead):
    chosen = plan(RECIPE, HARDWARE, alive(dead), use_all=True)
    assert chosen.layout.ranks == tuple(alive(dead))  # every slot busy, as the demo plans
    assert mixed_tp(chosen.layout.to_dict()), chosen.layout.describe()
    for pipeline in chosen.cost.pipelines:
        for stage in pipeline.stages:
            assert stage.memory.total <= slot_bytes(HARDWARE)


def test_mixed_tp_names_the_pipelines_whose_stages_differ():
    layout = {"pipelines": [{"stages": [{"tp": 2}, {"tp": 2}]},
                            {"stages": [{"tp": 2}, {"tp": 1}, {"tp": 2}]}]}
    assert mixed_tp(layout) == ["P1: TP 2, 1, 2"]


def test_a_cached_profile_measured_on_top_of_other_memory_is_not_reused(tmp_path):
    """A demo run directory keeps the profile it measured; after ``--hardware`` (or its
    default) changes the slots' memory, that cache must not plan the next run."""
    data = yaml.safe_load(DEFAULT_HARDWARE.read_text())
    data["memory_per_gpu_gib"] = 4
    data["measured"][RECIPE.name]["measured_on"]["host"] = socket.gethostname()
    (tmp_path / CACHED_NAME).write_text(yaml.safe_dump(data))
    lines: list[str] = []
    choice = choose_profile(tmp_path, DEMO.recipe, RECIPE, DEFAULT_HARDWARE, "cpu", False,
                            lines.append)
    assert choice.path == DEFAULT_HARDWARE
    assert choice.hardware.memory_per_gpu_gib == HARDWARE.memory_per_gpu_gib
    assert len(lines) == 1 and "measured on top of another profile" in lines[0]
