"""``elastor train``: validate a recipe and layout, then run them under torchrun, each
rank forked from a pre-imported worker (``elastic.prestart``) unless ``--no-zygote``."""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import replace

from elastor_mcore.checkpoint import CheckpointError
from elastor_mcore.checkpoint.lease import CheckpointLease, new_job_id
from elastor_mcore.cli.stopping import report_stop, stopped_by
from elastor_mcore.config.data import (DataConfig, DataFlagError, add_data_args,
                                       data_config_from_args)
from elastor_mcore.config.launch import LaunchSettings
from elastor_mcore.config.recipe import RecipeError, load_recipe
from elastor_mcore.config.run import RunSettings
from elastor_mcore.data.config import validate_data_config
from elastor_mcore.data.errors import DataError
from elastor_mcore.elastic import prestart
from elastor_mcore.elastic.job import RankCommand, Trainer
from elastor_mcore.elastic.torchrun import run_torchrun
from elastor_mcore.parallel.layout import LayoutError, load_layout


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train", help="train a recipe on a layout (launches torchrun itself)",
        description="Train a recipe on a (possibly heterogeneous) layout. The world size "
                    "is the layout's; ranks the layout does not use stay idle.")
    RunSettings.add_arguments(parser, "train", {"memory_interval": {"default": 0}})
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks to start (default: the layout's); extra ranks stay idle")
    LaunchSettings.add_arguments(parser, "train")  # --zygote / --no-zygote
    add_data_args(parser, "train")
    parser.set_defaults(func=run)


def check_resume_source(load_dir: str, recipe, settings: RunSettings) -> None:
    """Fail before any process starts when --load cannot be resumed from (another model,
    seed, batch, corpus or tokenizer; ``settings.data`` carries the fingerprint)."""
    from elastor_mcore import checkpoint
    from elastor_mcore.runtime.state import check_resumable

    check_resumable(checkpoint.open(load_dir).manifest, recipe,
                    settings.seed_for(recipe.training.seed), settings.data,
                    settings.allow_data_change)


def run(args: argparse.Namespace) -> int:
    try:
        recipe = load_recipe(args.recipe)
        layout = load_layout(args.layout, recipe)
        settings = RunSettings.from_args(args, "train", data=data_config_from_args(
            args, "train", default=DataConfig(kind="synthetic")))
        print(f"elastor train: data: {settings.data.describe()}", flush=True)
        validate_data_config(settings.data, recipe)  # fast, before the data pipeline's imports
        from elastor_mcore.data.prepare import prepare_data
        summary = prepare_data(settings.data, recipe)
        if summary.index_built:
            print(f"elastor train: indexed {summary.documents:,} documents "
                  f"({summary.tokens:,} tokens) in {summary.seconds:.1f}s", flush=True)
        settings = replace(settings, data=replace(settings.data, fingerprint=summary.fingerprint))
        if settings.load_dir:
            check_resume_source(settings.load_dir, recipe, settings)
    except (RecipeError, LayoutError, CheckpointError, DataError, DataFlagError) as exc:
        print(f"elastor train: {exc}", file=sys.stderr)
        return 2
    if settings.steps <= 0:
        print("elastor train: --steps must be positive", file=sys.stderr)
        return 2
    world = args.world_size or layout.world_size
    if world < layout.world_size:
        print(f"elastor train: --world-size {world} is smaller than the {layout.world_size} "
              f"ranks the layout uses", file=sys.stderr)
        return 2
    lease = CheckpointLease(settings.save_dir, new_job_id()) if settings.save_dir else None
    try:
        if lease:
            lease.acquire()
    except CheckpointError as exc:
        print(f"elastor train: {exc}", file=sys.stderr)
        return 2
    print(f"elastor train: {recipe.name} on {layout.num_gpus} of {world} ranks: "
          f"{layout.describe()}", flush=True)
    try:
        result = run_ranks(world, RankCommand(Trainer.module, settings.to_argv("worker")),
                           args.zygote)
    finally:
        if lease:
            lease.release()
    signum = stopped_by(result.returncode)
    if signum:
        return report_stop("elastor train", signum, settings.save_dir)
    if result.returncode:
        print(f"elastor train: a rank failed (exit code {result.returncode}); its error is "
              f"above", file=sys.stderr)
    return result.returncode


def run_ranks(world: int, rank: RankCommand, zygote: bool) -> subprocess.CompletedProcess:
    """Run ``world`` ranks of ``rank`` to the end. With ``zygote`` and more than one
    rank, each rank runs under a keeper, forked from a pre-imported worker started for
    this run: the ranks do not each import torch and Megatron-Core (seconds of CPU a
    rank); a single rank would only wait for the worker's imports."""
    with prestart.prestarted(zygote and world > 1) as env:
        if env:
            rank = prestart.keeper_command(rank, in_place=False)
        return run_torchrun(world, rank.module, rank.args, env=env)
