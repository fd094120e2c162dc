"""``elastor launch``: train under the elastic supervisor, recovering from failures
on the surviving slots (see ``docs/elastic.md``)."""

from __future__ import annotations

import argparse
import socket
import sys
from dataclasses import replace
from typing import Any

from elastor_mcore.checkpoint.format import CheckpointError, latest_step
from elastor_mcore.cli.stopping import report_stop
from elastor_mcore.cli.train import check_resume_source
from elastor_mcore.config.data import DataConfig, add_data_args, data_config_from_args
from elastor_mcore.config.failure_plan import FailurePlanError, load_failure_plan
from elastor_mcore.config.launch import LaunchSettings, NodeSettings
from elastor_mcore.config.recipe import RecipeError, load_recipe
from elastor_mcore.config.run import RunSettings
from elastor_mcore.data.config import validate_data_config
from elastor_mcore.data.errors import DataError
from elastor_mcore.elastic import node_timeline
from elastor_mcore.elastic.node import NodeConfig, NodeLauncher
from elastor_mcore.elastic.supervisor import Outcome, Supervisor, SupervisorConfig
from elastor_mcore.elastic.report import segments
from elastor_mcore.elastic.timeline import LaunchRecord, recoveries, table
from elastor_mcore.planner import HardwareError, load_hardware


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "launch", help="train under the elastic supervisor (recovers from failures)",
        description="Plan a layout for the slots, run it under torchrun and watch it. "
                    "When a rank exits non-zero or stops heart-beating, stop the job, find "
                    "the surviving slots, re-plan and relaunch from the latest committed "
                    "checkpoint.")
    RunSettings.add_arguments(parser, "launch", {
        "steps": {"help": "optimizer steps in all"},
        "save_interval": {"required": True,
                          "help": "save every K steps (a failure redoes at most K steps)"}})
    LaunchSettings.add_arguments(parser, "launch")
    NodeSettings.add_arguments(parser.add_argument_group(
        "several nodes", "run this command on every node with the same recipe, profile, "
        "--rdzv-endpoint and --rdzv-id: torch's elastic agent (c10d rendezvous) starts this "
        "node's --slots workers at every round, and each round plans on the healthy "
        "devices of the nodes present (see docs/elastic.md). Without --rdzv-endpoint: one "
        "host, standalone"), "launch")
    add_data_args(parser, "launch")
    parser.set_defaults(func=run)


def devices(choice: str) -> str:
    if choice != "auto":
        return choice
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def settings_from_args(args: argparse.Namespace) -> tuple[RunSettings, LaunchSettings]:
    """The run and launcher settings of the flags, ``devices`` resolved."""
    settings = RunSettings.from_args(
        args, "launch",
        data=data_config_from_args(args, "launch", default=DataConfig(kind="synthetic")))
    launch = LaunchSettings.from_args(args, "launch")
    return settings, replace(launch, devices=devices(launch.devices))


def build_config(args: argparse.Namespace) -> SupervisorConfig:
    """Validate every input (raising with the field and the fix) before anything runs."""
    recipe = load_recipe(args.recipe)
    settings, launch = settings_from_args(args)
    hardware = load_hardware(launch.hardware)
    count = launch.slots
    if count is None:
        if launch.devices == "cuda":
            import torch
            count = torch.cuda.device_count()
        else:
            count = hardware.gpus_per_node
    if count <= 0:
        raise ValueError(f"--slots must be positive, got {count}")
    failures = load_failure_plan(settings.failure_plan) if settings.failure_plan else ()
    return SupervisorConfig(settings=settings, launch=launch, recipe=recipe, failures=failures,
                            hardware=hardware, slots=tuple(range(count)))


class StepPrinter:
    """One progress line every ``every`` steps and at the first step of each launch."""

    def __init__(self, steps: int, every: int = 1, prefix: str = "elastor launch") -> None:
        self.steps, self.every, self.prefix = steps, every, prefix
        self.first: set[int] = set()

    def __call__(self, launch: LaunchRecord, m: dict[str, Any]) -> None:
        first = launch.index not in self.first
        self.first.add(launch.index)
        if first or m["step"] % self.every == 0 or m["step"] == self.steps:
            print(f"{self.prefix}:   step {m['step']:4d}/{self.steps}  loss {m['loss']:.6f}  "
                  f"{m['time_s']:.2f}s/step  on {len(launch.current_slots())} slots",
                  flush=True)


def print_summary(outcome: Outcome, prefix: str) -> None:
    items = recoveries(outcome.launches)
    if items:
        print(f"{prefix}: recovery timeline (seconds)")
        print(table(items))
    layouts = " -> ".join(f"{len(l.slots)}" for l in segments(outcome.launches))
    print(f"{prefix}: {'finished' if outcome.finished else 'FAILED'}: {outcome.reason}; "
          f"slots per layout: {layouts}", flush=True)


def build_node_config(args: argparse.Namespace, nodes: NodeSettings) -> NodeConfig:
    """The multi-node form of ``build_config`` (one node of the job)."""
    if args.measure_profile:
        raise ValueError("--measure-profile measures on one host: run elastor profile on a "
                         "node first and pass the profile it writes as --hardware")
    recipe = load_recipe(args.recipe)
    settings, launch = settings_from_args(args)
    load_hardware(launch.hardware)
    count = launch.slots
    if count is None:
        import torch
        count = torch.cuda.device_count() if launch.devices == "cuda" else 1
    failures = load_failure_plan(settings.failure_plan) if settings.failure_plan else ()
    return NodeConfig(settings=settings, launch=launch, recipe=recipe, failures=failures,
                      nodes=replace(nodes, node_name=nodes.node_name or socket.gethostname()),
                      slots=count)


def run_node(args: argparse.Namespace, nodes: NodeSettings, prefix: str) -> int:
    """One node of a multi-node job: its elastic agent until the job ends."""
    try:
        config = build_node_config(args, nodes)
        validate_data_config(config.settings.data, config.recipe)
        from elastor_mcore.data.source import prepare_data
        summary = prepare_data(config.settings.data, config.recipe)
        config = replace(config, settings=replace(config.settings, data=replace(
            config.settings.data, fingerprint=summary.fingerprint)))
    except (RecipeError, HardwareError, FailurePlanError, DataError, CheckpointError,
            ValueError) as exc:
        print(f"{prefix}: {exc}", file=sys.stderr)
        return 2
    launcher = NodeLauncher(config, on_message=lambda line: print(f"{prefix}: {line}",
                                                                  flush=True))
    try:
        outcome = launcher.run()
    except CheckpointError as exc:  # another job holds the checkpoint root
        print(f"{prefix}: {exc}", file=sys.stderr)
        return 2
    if outcome.timeline and outcome.timeline.recoveries:
        print(f"{prefix}: node {config.node}: recoveries seen here (seconds)")
        print(node_timeline.table(outcome.timeline))
    rounds = " -> ".join(f"{r.ranks}" for r in outcome.timeline.rounds) \
        if outcome.timeline else "-"
    print(f"{prefix}: node {config.node}: {'finished' if outcome.finished else 'FAILED'}: "
          f"{outcome.reason}; ranks per round: {rounds}; timeline in "
          f"{outcome.node_dir / 'timeline.json'}", flush=True)
    if outcome.stopped_by:
        return report_stop(prefix, outcome.stopped_by, config.checkpoint_dir)
    return 0 if outcome.finished else 1


def run(args: argparse.Namespace) -> int:
    prefix = "elastor launch"
    nodes = NodeSettings.from_args(args, "launch")
    try:
        nodes.check()
    except ValueError as exc:
        print(f"{prefix}: {exc}", file=sys.stderr)
        return 2
    if nodes.several:
        return run_node(args, nodes, prefix)
    try:
        config = build_config(args)
        data = config.settings.data
        print(f"{prefix}: data: {data.describe()}", flush=True)
        print(f"{prefix}: checkpoints: {config.checkpoint_dir}", flush=True)
        validate_data_config(data, config.recipe)  # fast, before the data pipeline's imports
        from elastor_mcore.data.source import prepare_data
        summary = prepare_data(data, config.recipe)  # once, before any rank starts
        settings = replace(config.settings, data=replace(data, fingerprint=summary.fingerprint))
        config = replace(config, settings=settings)
        if latest_step(config.checkpoint_dir) is not None:  # a rerun resumes: check it now
            check_resume_source(str(config.checkpoint_dir), config.recipe, settings)
    except (RecipeError, HardwareError, FailurePlanError, DataError, CheckpointError,
            ValueError) as exc:
        print(f"{prefix}: {exc}", file=sys.stderr)
        return 2
    supervisor = Supervisor(config, on_message=lambda line: print(f"{prefix}: {line}",
                                                                  flush=True),
                            on_step=StepPrinter(config.settings.steps, prefix=prefix))
    try:
        outcome = supervisor.run()
    except CheckpointError as exc:  # another job holds the checkpoint root
        print(f"{prefix}: {exc}", file=sys.stderr)
        return 2
    print_summary(outcome, prefix)
    print(f"{prefix}: timeline in {config.run_dir / 'timeline.json'}")
    if outcome.stopped_by:
        return report_stop(prefix, outcome.stopped_by, config.checkpoint_dir)
    return 0 if outcome.finished else 1
