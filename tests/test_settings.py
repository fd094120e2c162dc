"""Settings defined once (``config/``): every argv that one process builds for another
comes from the fields' metadata, and the receiving entry point's own parser reads back
exactly the settings it was given, for every field (a field added later is caught by
``test_every_field_is_set`` until it is set here too)."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, asdict, fields, replace

import pytest

from elastor_mcore.checkpoint import SavePolicy
from elastor_mcore.config.data import DataConfig
from elastor_mcore.config.launch import LaunchSettings, NodeSettings, RoundSettings
from elastor_mcore.config.profile import MeasureSettings
from elastor_mcore.config.run import RunSettings, SaveOptions
from elastor_mcore.elastic.job import TRAINER
from elastor_mcore.elastic.rank import measure, node_worker, worker

DATA = DataConfig(kind="jsonl", paths=("a.jsonl", "dir"), tokenizer="tok", malformed="skip",
                  workers=2, prefetch_depth=8, index_workers=3, cache_dir="cache",
                  shuffle=True, fingerprint="abc")
RUN = RunSettings(recipe="r.yaml", layout="l.yaml", steps=7, seed=3, metrics_out="m.jsonl",
                  save_dir="s3://bucket/prefix", save_interval=2,
                  saving=SaveOptions(keep=3, asynchronous=False, when_busy="skip",
                                     on_error="continue"),
                  load_dir="load", report_memory=True, allow_data_change=True, data=DATA,
                  failure_plan="plan.yaml", hardware="hw.yaml", elastic_dir="launch0",
                  rank_slots=(0, 2, 5), memory_interval=3, recovery="relaunch",
                  replan_all_slots=True)
ROUND = RoundSettings(node_name="a", node_dir="run/nodes/a/0", store_endpoint="h:29500",
                      job_id="job", devices="cuda", probe_timeout=12.5, health_file="dead.yaml",
                      use_all_slots=True)
MEASURE = MeasureSettings(recipe="r.yaml", hardware="hw.yaml", tp_sizes=(1, 2), repeats=4,
                          max_spread=0.5, raw_out="raw.json", links_only=True,
                          profile_out="p.yaml")


def unset(obj, skip: tuple[str, ...] = ()) -> list[str]:
    """The fields of ``obj`` (nested ones included) still at their default."""
    out = []
    for f in fields(obj):
        value = getattr(obj, f.name)
        if f.metadata.get("nested"):
            out += [f"{f.name}.{n}" for n in unset(value)]
            continue
        default = f.default if f.default is not MISSING else (
            f.default_factory() if f.default_factory is not MISSING else MISSING)
        if value == default and f.name not in skip:
            out.append(f.name)
    return out


@pytest.mark.parametrize("settings, skip", [
    (RUN, ()), (DATA, ()), (ROUND, ()),
    (MEASURE, ("out", "devices")),  # elastor profile's own: not passed to the world
])
def test_every_field_is_set(settings, skip):
    assert unset(settings, skip) == []


def test_the_training_rank_reads_back_every_run_setting():
    assert worker.parse_args(TRAINER.launch_command(RUN).args) == RUN


def test_a_round_rank_reads_back_the_run_and_the_node_launchers_settings():
    no_layout = replace(RUN, layout=None)  # the round plans it
    assert node_worker.parse_args(TRAINER.round_command(no_layout, ROUND).args) == \
        (no_layout, ROUND)


def test_the_measurement_world_reads_back_its_settings():
    assert measure.parse_args(MEASURE.to_argv("measure")) == MEASURE
    with pytest.raises(SystemExit):  # the world needs the TP degrees
        measure.parse_args(replace(MEASURE, tp_sizes=None).to_argv("measure"))


def test_a_commands_defaults_are_the_fields():
    parser = argparse.ArgumentParser()
    LaunchSettings.add_arguments(parser, "launch")
    NodeSettings.add_arguments(parser, "launch")
    args = parser.parse_args(["--hardware", "hw.yaml", "--run-dir", "run"])
    assert LaunchSettings.from_args(args, "launch") == LaunchSettings(hardware="hw.yaml",
                                                                      run_dir="run")
    assert NodeSettings.from_args(args, "launch") == NodeSettings()
    parser = argparse.ArgumentParser()
    RunSettings.add_arguments(parser, "train")
    args = parser.parse_args(["--recipe", "r.yaml", "--layout", "dp1-tp1-pp1", "--steps", "2"])
    assert RunSettings.from_args(args, "train") == RunSettings(recipe="r.yaml",
                                                               layout="dp1-tp1-pp1", steps=2)


def test_the_save_policy_is_the_run_settings():
    policy = SavePolicy(**asdict(RUN.saving))
    assert (policy.keep, policy.asynchronous, policy.when_busy, policy.on_error) == \
        (3, False, "skip", "continue")
    assert SavePolicy() == SavePolicy(**asdict(SaveOptions()))


@pytest.mark.parametrize("values, message", [
    ({"slots": 0}, "--slots must be positive, got 0"),
    ({"max_restarts": -1}, "--max-restarts must be >= 0, got -1"),
    ({"probe_timeout": -5.0}, "--probe-timeout must be >= 0"),
])
def test_bad_launcher_settings_name_the_flag(values, message):
    with pytest.raises(ValueError, match=message):
        LaunchSettings(hardware="hw.yaml", run_dir="run", **values)
