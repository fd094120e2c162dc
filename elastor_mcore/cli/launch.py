"""``elastor launch``: train under the elastic supervisor, recovering from failures
on the surviving slots (see ``docs/elastic.md``): a recipe with the project's trainer,
or Megatron-LM's own ``pretrain_gpt.py`` (``--megatron-lm PATH -- <its flags>``, see
``docs/megatron-lm.md``)."""

from __future__ import annotations

import argparse
import socket
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from elastor_mcore.checkpoint.format import CheckpointError, latest_step
from elastor_mcore.cli.stopping import report_stop
from elastor_mcore.cli.train import check_resume_source
from elastor_mcore.config.data import DataConfig, add_data_args, data_config_from_args
from elastor_mcore.config.failure_plan import Failure, FailurePlanError, load_failure_plan
from elastor_mcore.config.launch import LaunchSettings, MegatronSettings, NodeSettings
from elastor_mcore.config.recipe import Recipe, RecipeError, load_recipe
from elastor_mcore.config.run import RunSettings
from elastor_mcore.data.config import validate_data_config
from elastor_mcore.data.errors import DataError
from elastor_mcore.elastic import megatron, node_timeline
from elastor_mcore.elastic.job import JobConfig, Trainer, Workload
from elastor_mcore.elastic.node import NodeConfig, NodeLauncher
from elastor_mcore.elastic.report import segments
from elastor_mcore.elastic.supervisor import Outcome, Supervisor, SupervisorConfig
from elastor_mcore.elastic.timeline import LaunchRecord, recoveries, table
from elastor_mcore.planner import HardwareError, load_hardware


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "launch", help="train under the elastic supervisor (recovers from failures)",
        description="Plan a layout for the slots, run it under torchrun and watch it. "
                    "When a rank exits non-zero or stops heart-beating, stop the job, find "
                    "the surviving slots, re-plan and relaunch from the latest committed "
                    "checkpoint. The ranks run the project's trainer on --recipe, or "
                    "Megatron-LM's pretrain_gpt.py (--megatron-lm PATH -- <its flags>).")
    RunSettings.add_arguments(parser, "launch", {
        "recipe": {"default": None, "help": "recipe YAML (model + training); required "
                                            "unless --megatron-lm"},
        "steps": {"default": None, "help": "optimizer steps in all (with --megatron-lm: "
                                           "its --train-iters)"},
        "save_interval": {"default": None,
                          "help": "save every K steps (a failure redoes at most K steps; "
                                  "with --megatron-lm: its --save-interval)"}})
    LaunchSettings.add_arguments(parser, "launch")
    MegatronSettings.add_arguments(parser, "launch")
    parser.add_argument("megatron_args", nargs="*", metavar="-- MEGATRON_LM_FLAGS",
                        help="with --megatron-lm: pretrain_gpt.py's flags, after --")
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


def run_settings(args: argparse.Namespace) -> RunSettings:
    """The trainer's run settings of the flags."""
    return RunSettings.from_args(
        args, "launch",
        data=data_config_from_args(args, "launch", default=DataConfig(kind="synthetic")))


def resolved_launch(args: argparse.Namespace) -> LaunchSettings:
    """The launcher settings of the flags, ``devices`` resolved."""
    launch = LaunchSettings.from_args(args, "launch")
    return replace(launch, devices=devices(launch.devices))


def check_workload_flags(args: argparse.Namespace) -> None:
    """``--recipe``, ``--steps`` and ``--save-interval`` for the project's trainer; with
    ``--megatron-lm`` none of the trainer's flags (Megatron-LM's own say it all)."""
    if args.script is None:
        missing = [flag for flag, value in (("--recipe", args.recipe), ("--steps", args.steps),
                                            ("--save-interval", args.save_interval))
                   if value is None]
        if missing:
            raise ValueError(f"{', '.join(missing)} required (or run Megatron-LM's "
                             f"pretrain_gpt.py: --megatron-lm PATH -- <its flags>)")
        if args.megatron_args:
            raise ValueError(f"unexpected arguments {' '.join(args.megatron_args)}: flags "
                             f"after -- are Megatron-LM's, with --megatron-lm")
        return
    trainer = [*RunSettings.given(args, "launch"), *DataConfig.given(args, "launch")]
    trainer = [flag for flag in trainer if flag != "--failure-plan"]
    if args.synthetic_data or args.data or args.data_path:
        trainer.append("the data flags")
    if trainer:
        raise ValueError(f"{', '.join(trainer)}: the project trainer's flags; with "
                         f"--megatron-lm give Megatron-LM's own after -- (--train-iters, "
                         f"--save-interval, --seed, its data flags, ...)")
    if not args.megatron_args:
        raise ValueError(f"--megatron-lm {args.script}: give pretrain_gpt.py's flags after --")


def slot_count(launch: LaunchSettings, gpus_per_node: int) -> int:
    """``--slots``, or every visible GPU on CUDA, one node's worth on CPU."""
    count = launch.slots
    if count is None:
        if launch.devices == "cuda":
            import torch
            count = torch.cuda.device_count()
        else:
            count = gpus_per_node
    if count <= 0:
        raise ValueError(f"--slots must be positive, got {count}")
    return count


def workload_of(args: argparse.Namespace, prefix: str
                ) -> tuple[Workload, Recipe, LaunchSettings, tuple[Failure, ...]]:
    """What the ranks run (the trainer on ``--recipe``, or the Megatron-LM job of the
    flags after ``--``, read by Megatron-LM's parser), its recipe, the launch settings
    (``devices`` resolved; under Megatron-LM the checkpoint root is ``--checkpoint-dir``,
    else its ``--save``) and the failure plan."""
    check_workload_flags(args)
    launch = resolved_launch(args)
    failures = load_failure_plan(args.failure_plan) if args.failure_plan else ()
    if args.script is None:
        return Trainer(run_settings(args)), load_recipe(args.recipe), launch, failures
    workload = megatron.prepare(args.script, args.megatron_args, Path(launch.run_dir),
                                args.failure_plan,
                                on_message=lambda line: print(f"{prefix}: {line}", flush=True))
    root = megatron.checkpoint_root(workload.job, launch.checkpoint_dir)
    return workload, workload.recipe, replace(launch, checkpoint_dir=root), failures


def build_config(args: argparse.Namespace, prefix: str = "elastor launch") -> SupervisorConfig:
    """Validate every input (raising with the field and the fix) before anything runs."""
    workload, recipe, launch, failures = workload_of(args, prefix)
    hardware = load_hardware(launch.hardware)
    count = slot_count(launch, hardware.gpus_per_node)
    return SupervisorConfig(workload=workload, launch=launch, recipe=recipe,
                            failures=failures, hardware=hardware, slots=tuple(range(count)))


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
        for r in items:
            print(f"{prefix}:   {r.failure}: detected by {r.detected_by}")
    layouts = " -> ".join(f"{len(l.slots)}" for l in segments(outcome.launches))
    print(f"{prefix}: {'finished' if outcome.finished else 'FAILED'}: {outcome.reason}; "
          f"slots per layout: {layouts}", flush=True)


def build_node_config(args: argparse.Namespace, nodes: NodeSettings,
                      prefix: str) -> NodeConfig:
    """The multi-node form of ``build_config`` (one node of the job)."""
    if args.measure_profile:
        raise ValueError("--measure-profile measures on one host: run elastor profile on a "
                         "node first and pass the profile it writes as --hardware")
    workload, recipe, launch, failures = workload_of(args, prefix)
    load_hardware(launch.hardware)
    count = launch.slots
    if count is None:
        import torch
        count = torch.cuda.device_count() if launch.devices == "cuda" else 1
    return NodeConfig(workload=workload, launch=launch, recipe=recipe, failures=failures,
                      nodes=replace(nodes, node_name=nodes.node_name or socket.gethostname()),
                      slots=count)


def with_trainer_data(config: JobConfig, prefix: str) -> JobConfig:
    """The trainer's data prepared once, before any rank starts (its fingerprint set);
    Megatron-LM reads its own data."""
    if not isinstance(config.workload, Trainer):
        return config
    settings = config.workload.settings
    print(f"{prefix}: data: {settings.data.describe()}", flush=True)
    validate_data_config(settings.data, config.recipe)  # fast, before the pipeline's imports
    from elastor_mcore.data.prepare import prepare_data
    summary = prepare_data(settings.data, config.recipe)
    data = replace(settings.data, fingerprint=summary.fingerprint)
    return replace(config, workload=Trainer(replace(settings, data=data)))


def report_job_stop(prefix: str, signum: int, config: JobConfig) -> int:
    """``report_stop`` with the workload's own latest committed step."""
    return report_stop(prefix, signum, config.checkpoint_dir,
                       latest=lambda root: max(config.workload.committed_steps(root),
                                               default=None))


def run_node(args: argparse.Namespace, nodes: NodeSettings, prefix: str) -> int:
    """One node of a multi-node job: its elastic agent until the job ends."""
    try:
        config = with_trainer_data(build_node_config(args, nodes, prefix), prefix)
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
        return report_job_stop(prefix, outcome.stopped_by, config)
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
        config = with_trainer_data(build_config(args, prefix), prefix)
        print(f"{prefix}: checkpoints: {config.checkpoint_dir}", flush=True)
        workload = config.workload
        if isinstance(workload, Trainer) and latest_step(config.checkpoint_dir) is not None:
            # a rerun resumes: check it now
            check_resume_source(str(config.checkpoint_dir), config.recipe, workload.settings)
    except (RecipeError, HardwareError, FailurePlanError, DataError, CheckpointError,
            ValueError) as exc:
        print(f"{prefix}: {exc}", file=sys.stderr)
        return 2
    supervisor = Supervisor(config, on_message=lambda line: print(f"{prefix}: {line}",
                                                                  flush=True),
                            on_step=StepPrinter(config.workload.steps, prefix=prefix))
    try:
        outcome = supervisor.run()
    except CheckpointError as exc:  # another job holds the checkpoint root
        print(f"{prefix}: {exc}", file=sys.stderr)
        return 2
    print_summary(outcome, prefix)
    print(f"{prefix}: timeline in {config.run_dir / 'timeline.json'}")
    if outcome.stopped_by:
        return report_job_stop(prefix, outcome.stopped_by, config)
    return 0 if outcome.finished else 1
