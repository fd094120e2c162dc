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
from elastor_mcore.config.launch import (LaunchSettings, MegatronSettings, NodeSettings,
                                         RoundSettings)
from elastor_mcore.config.profile import MeasureSettings
from elastor_mcore.config.run import RunSettings, SaveOptions
from elastor_mcore.elastic.job import Launch, Trainer
from elastor_mcore.elastic.megatron import MegatronLM
from elastor_mcore.elastic.rank import measure, megatron, node_worker, worker
from elastor_mcore.integrations.megatron_lm.launch_flags import MegatronJob

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
MEGATRON = MegatronSettings(script="pretrain_gpt.py", job="run/megatron-job.json",
                            elastic_dir="run/launch0", metrics_out="run/launch0/metrics.jsonl",
                            rank_slots=(0, 2, 5), failure_plan="plan.yaml",
                            checkpoint_dir="s3://bucket/prefix", hardware="hw.yaml")
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
    (RUN, ()), (DATA, ()), (ROUND, ()), (MEGATRON, ()),
    (MEASURE, ("out", "devices")),  # elastor profile's own: not passed to the world
])
def test_every_field_is_set(settings, skip):
    assert unset(settings, skip) == []


LAUNCH = Launch(directory="run/launch0", layout="run/launch0/layout.yaml", slots=(0, 2, 5),
                checkpoint_dir="s3://bucket/prefix", load_step=4, hardware="hw.yaml",
                use_all_slots=True)


def test_the_training_rank_reads_back_every_run_setting():
    launched = replace(RUN, layout=LAUNCH.layout, metrics_out=LAUNCH.metrics_out,
                       save_dir=LAUNCH.checkpoint_dir,
                       load_dir="s3://bucket/prefix/step_00000004",
                       elastic_dir=LAUNCH.directory, rank_slots=LAUNCH.slots,
                       hardware=LAUNCH.hardware, replan_all_slots=LAUNCH.use_all_slots)
    run = replace(RUN, replan_all_slots=False)  # the launch sets it
    assert worker.parse_args(Trainer(run).launch_command(LAUNCH).args) == launched


def test_a_round_rank_reads_back_the_run_and_the_node_launchers_settings():
    no_layout = replace(RUN, layout=None)  # the round plans it
    command = Trainer(no_layout).round_command(ROUND, "ckpt", "hw2.yaml", "run/nodes/a/0")
    assert node_worker.parse_args(command.args) == (
        replace(no_layout, save_dir="ckpt", hardware="hw2.yaml", elastic_dir="run/nodes/a/0"),
        ROUND)


MEGATRON_ARGV = ("--num-layers", "8", "--train-iters", "8")
MEGATRON_JOB = MegatronJob(recipe={}, train_iters=8, save_interval=2, save=None, load=None,
                           arguments={})


def test_a_megatron_rank_reads_back_its_settings_and_pretrain_gpts_flags():
    """A launch's rank gets its settings, then the user's flags and the launch's own
    (layout, zarr saves and the iteration to resume) after ``--``."""
    workload = MegatronLM(replace(MEGATRON, elastic_dir=None, metrics_out=None,
                                  rank_slots=None, checkpoint_dir=None, hardware=None),
                          MEGATRON_ARGV, MEGATRON_JOB, "run/megatron-recipe.yaml")
    settings, node, argv = megatron.parse_args(workload.launch_command(LAUNCH).args)
    assert settings == replace(MEGATRON, checkpoint_dir=None, hardware=None,
                               metrics_out=LAUNCH.metrics_out, elastic_dir=LAUNCH.directory)
    assert node is None
    assert argv == [*MEGATRON_ARGV, "--elastor-layout", LAUNCH.layout, "--elastor-ckpt-format",
                    "zarr", "--save", LAUNCH.checkpoint_dir, "--load", LAUNCH.checkpoint_dir,
                    "--ckpt-step", "4"]
    round_command = workload.round_command(ROUND, "ckpt", "hw.yaml", "run/nodes/a/0")
    assert megatron.parse_args(round_command.args) == (
        replace(MEGATRON, metrics_out=None, rank_slots=None, elastic_dir="run/nodes/a/0",
                checkpoint_dir="ckpt"), ROUND, list(MEGATRON_ARGV))


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
