"""``elastor launch``: train under the elastic supervisor, recovering from failures
on the surviving slots (see ``docs/elastic.md``)."""

from __future__ import annotations

import argparse
import re
import socket
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from elastor_mcore.checkpoint.format import CheckpointError, latest_step
from elastor_mcore.cli.stopping import report_stop
from elastor_mcore.cli.train import check_resume_source
from elastor_mcore.config.failure_plan import FailurePlanError, load_failure_plan
from elastor_mcore.config.recipe import RecipeError, load_recipe
from elastor_mcore.config.run import DataConfig, RunSettings
from elastor_mcore.data.config import add_data_args, data_config_from_args, validate_data_config
from elastor_mcore.data.errors import DataError
from elastor_mcore.elastic import node_timeline
from elastor_mcore.elastic.heartbeat import HangPolicy
from elastor_mcore.elastic.node import NodeConfig, NodeLauncher
from elastor_mcore.elastic.supervisor import Outcome, Supervisor, SupervisorConfig
from elastor_mcore.elastic.timeline import LaunchRecord, recoveries, table
from elastor_mcore.elastic.torchrun import Rendezvous
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
    parser.add_argument("--hardware", required=True,
                        help="hardware profile YAML for the planner, e.g. "
                             "recipes/hardware/cpu-slots.yaml")
    parser.add_argument("--measure-profile", action="store_true",
                        help="unless --hardware or DIR/hardware-profile.yaml was measured "
                             "on this machine for the recipe (elastor profile), measure one "
                             "first and cache it there; either measured profile replaces "
                             "--hardware for planning")
    parser.add_argument("--slots", type=int, default=None, metavar="N",
                        help="slots 0..N-1 (node-major, the profile's gpus_per_node per "
                             "node; default: one node on CPU, every visible GPU on CUDA)")
    parser.add_argument("--run-dir", required=True, metavar="DIR",
                        help="checkpoints, per-launch logs and timeline.json go here")
    parser.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                        help="checkpoint root instead of DIR/checkpoints: a directory or "
                             "s3://BUCKET/PREFIX (endpoint and credentials from the AWS "
                             "environment); every launch saves there and a relaunch "
                             "resumes from its latest committed step")
    parser.add_argument("--max-restarts", type=int, default=3, metavar="N",
                        help="give up after N recoveries (default 3); with several nodes, "
                             "torch's --max-restarts of each node's agent (a node joining "
                             "does not count)")
    parser.add_argument("--heartbeat-timeout", type=float, default=60.0, metavar="S",
                        help="a rank silent for S seconds after its first step is hung "
                             "(default 60)")
    parser.add_argument("--startup-timeout", type=float, default=300.0, metavar="S",
                        help="silence allowed before a rank's first step of a launch: "
                             "imports, model build, checkpoint load (default 300)")
    parser.add_argument("--devices", choices=("auto", "cpu", "cuda"), default="auto",
                        help="cuda probes each GPU after a failure (default: cuda if "
                             "available)")
    parser.add_argument("--probe-timeout", type=float, default=60.0, metavar="S")
    nodes = parser.add_argument_group(
        "several nodes", "run this command on every node with the same recipe, profile, "
        "--rdzv-endpoint and --rdzv-id: torch's elastic agent (c10d rendezvous) starts this "
        "node's --slots workers at every round, and each round plans on the healthy "
        "devices of the nodes present (see docs/elastic.md). Without --rdzv-endpoint: one "
        "host, standalone")
    nodes.add_argument("--nnodes", default=None, metavar="MIN:MAX",
                       help="nodes in the job: the rounds start with at least MIN and "
                            "take up to MAX")
    nodes.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                       help="the rendezvous store; the node on HOST hosts it (it must "
                            "stay up for the whole job)")
    nodes.add_argument("--rdzv-id", default=None, metavar="ID",
                       help="the job's id, the same on every node")
    nodes.add_argument("--node-name", default=None, metavar="NAME",
                       help="this node's name in the job and its files (default: the "
                            "hostname; must differ between nodes)")
    nodes.add_argument("--rdzv-conf", default=None, metavar="K=V,...",
                       help="torchrun's --rdzv-conf, e.g. last_call_timeout=5 (the wait "
                            "for more nodes once MIN are there; torch's default is 30 s)")
    nodes.add_argument("--health-file", default=None, metavar="YAML",
                       help="a list of this node's dead slots, read at every round (an "
                            "external health check may write it)")
    add_data_args(parser)
    parser.set_defaults(func=run)


def devices(choice: str) -> str:
    if choice != "auto":
        return choice
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_config(args: argparse.Namespace) -> SupervisorConfig:
    """Validate every input (raising with the field and the fix) before anything runs."""
    recipe = load_recipe(args.recipe)
    hardware = load_hardware(args.hardware)
    kind = devices(args.devices)
    count = args.slots
    if count is None:
        if kind == "cuda":
            import torch
            count = torch.cuda.device_count()
        else:
            count = hardware.gpus_per_node
    if count <= 0:
        raise ValueError(f"--slots must be positive, got {count}")
    settings = RunSettings.from_args(
        args, "launch", data=data_config_from_args(args, default=DataConfig(kind="synthetic")))
    failures = load_failure_plan(settings.failure_plan) if settings.failure_plan else ()
    return SupervisorConfig(
        settings=settings, recipe=recipe, hardware=hardware, slots=tuple(range(count)),
        run_dir=Path(args.run_dir), checkpoint_root=args.checkpoint_dir, failures=failures,
        max_restarts=args.max_restarts,
        hang=HangPolicy(startup_timeout_s=args.startup_timeout,
                        timeout_s=args.heartbeat_timeout),
        devices=kind, probe_timeout_s=args.probe_timeout, hardware_path=Path(args.hardware),
        measure_profile=args.measure_profile)


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
                  f"{m['time_s']:.2f}s/step  on {len(launch.slots)} slots", flush=True)


def print_summary(outcome: Outcome, prefix: str) -> None:
    items = recoveries(outcome.launches)
    if items:
        print(f"{prefix}: recovery timeline (seconds)")
        print(table(items))
    layouts = " -> ".join(f"{len(l.slots)}" for l in outcome.launches)
    print(f"{prefix}: {'finished' if outcome.finished else 'FAILED'}: {outcome.reason}; "
          f"slots per launch: {layouts}", flush=True)


def build_node_config(args: argparse.Namespace, kind: str) -> NodeConfig:
    """The multi-node form of ``build_config`` (one node of the job)."""
    missing = [flag for flag, value in (("--nnodes", args.nnodes), ("--rdzv-id", args.rdzv_id))
               if value is None]
    if missing:
        raise ValueError(f"--rdzv-endpoint needs {' and '.join(missing)} too (the same on "
                         f"every node), e.g. --nnodes 1:4 --rdzv-id myjob")
    if not re.fullmatch(r"\d+(:\d+)?", args.nnodes):
        raise ValueError(f"--nnodes must be N or MIN:MAX, got {args.nnodes!r}")
    if not re.fullmatch(r"[^:]+:\d+", args.rdzv_endpoint):
        raise ValueError(f"--rdzv-endpoint must be HOST:PORT, got {args.rdzv_endpoint!r}")
    if args.measure_profile:
        raise ValueError("--measure-profile measures on one host: run elastor profile on a "
                         "node first and pass the profile it writes as --hardware")
    recipe = load_recipe(args.recipe)
    load_hardware(args.hardware)
    count = args.slots
    if count is None:
        import torch
        count = torch.cuda.device_count() if kind == "cuda" else 1
    settings = RunSettings.from_args(
        args, "launch", data=data_config_from_args(args, default=DataConfig(kind="synthetic")))
    failures = load_failure_plan(settings.failure_plan) if settings.failure_plan else ()
    return NodeConfig(
        settings=settings, recipe=recipe, hardware_path=Path(args.hardware),
        run_dir=Path(args.run_dir), node=args.node_name or socket.gethostname(),
        slots=count, rdzv=Rendezvous(args.rdzv_endpoint, args.rdzv_id, args.nnodes,
                                     args.max_restarts, args.rdzv_conf),
        failures=failures, hang=HangPolicy(startup_timeout_s=args.startup_timeout,
                                           timeout_s=args.heartbeat_timeout),
        devices=kind, probe_timeout_s=args.probe_timeout, checkpoint_root=args.checkpoint_dir,
        health_file=args.health_file)


def run_node(args: argparse.Namespace, prefix: str) -> int:
    """One node of a multi-node job: its elastic agent until the job ends."""
    try:
        config = build_node_config(args, devices(args.devices))
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
    if args.rdzv_endpoint is not None:
        return run_node(args, prefix)
    stray = [flag for flag, value in (("--nnodes", args.nnodes), ("--rdzv-id", args.rdzv_id),
                                      ("--node-name", args.node_name),
                                      ("--rdzv-conf", args.rdzv_conf),
                                      ("--health-file", args.health_file)) if value]
    if stray:
        print(f"{prefix}: {', '.join(stray)} need --rdzv-endpoint (a job of several "
              f"nodes); without it elastor launch runs on this host alone", file=sys.stderr)
        return 2
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
