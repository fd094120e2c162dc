"""``elastor train``: validate a recipe and layout, then run them under torchrun."""

from __future__ import annotations

import argparse
import sys

from elastor_mcore.checkpoint import CheckpointError
from elastor_mcore.data.config import DataConfig, add_data_args, data_config_from_args
from elastor_mcore.data.errors import DataError
from elastor_mcore.data.source import prepare_data
from elastor_mcore.elastic.torchrun import run_torchrun
from elastor_mcore.parallel.layout import LayoutError, load_layout
from elastor_mcore.config.recipe import RecipeError, load_recipe


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train", help="train a recipe on a layout (launches torchrun itself)",
        description="Train a recipe on a (possibly heterogeneous) layout. The world size "
                    "is the layout's; ranks the layout does not use stay idle.")
    parser.add_argument("--recipe", required=True, help="recipe YAML (model + training)")
    parser.add_argument("--layout", required=True,
                        help="layout YAML file or uniform shorthand like dp2-tp2-pp2")
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps to run")
    parser.add_argument("--seed", type=int, default=None,
                        help="override the recipe's seed")
    parser.add_argument("--metrics-out", default=None,
                        help="write JSON lines {step, loss, grad_norm, time_s, save_block_s, "
                             "save_in_flight} here")
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks to start (default: the layout's); extra ranks stay idle")
    parser.add_argument("--save", default=None, metavar="DIR",
                        help="checkpoint root: saves step_<N>/ every --save-interval steps "
                             "and at the end")
    parser.add_argument("--save-interval", type=int, default=0, metavar="K")
    parser.add_argument("--keep-checkpoints", type=int, default=2, metavar="N",
                        help="committed checkpoints to keep (default 2)")
    parser.add_argument("--async-save", action=argparse.BooleanOptionalAction, default=True,
                        help="write checkpoints in the background; training blocks only "
                             "for a copy into host buffers (default: on)")
    parser.add_argument("--save-when-busy", choices=("wait", "skip"), default="wait",
                        help="a save due while the previous one is still being written: "
                             "wait for it, or skip the new one (default: wait)")
    parser.add_argument("--on-save-error", choices=("stop", "continue"), default="stop",
                        help="a failed save (e.g. a full disk) stops the run, or is logged "
                             "and training continues; the previous checkpoint stays "
                             "loadable either way (default: stop)")
    parser.add_argument("--load", default=None, metavar="DIR",
                        help="resume from the latest committed step under DIR, under the "
                             "current layout (weights, optimizer, RNG, data position, step)")
    add_data_args(parser)
    parser.set_defaults(func=run)


def check_resume_source(load_dir: str, recipe, seed: int) -> None:
    """Fail before any process starts when --load cannot be resumed from."""
    from elastor_mcore import checkpoint
    from elastor_mcore.runtime.state import check_resumable

    check_resumable(checkpoint.open(load_dir).manifest, recipe, seed)


def run(args: argparse.Namespace) -> int:
    try:
        recipe = load_recipe(args.recipe)
        layout = load_layout(args.layout, recipe)
        seed = recipe.training.seed if args.seed is None else args.seed
        if args.load:
            check_resume_source(args.load, recipe, seed)
        data = data_config_from_args(args, default=DataConfig(kind="synthetic"))
        print(f"elastor train: data: {data.describe()}", flush=True)
        summary = prepare_data(data, recipe)
        if summary.index_built:
            print(f"elastor train: indexed {summary.documents:,} documents "
                  f"({summary.tokens:,} tokens) in {summary.seconds:.1f}s", flush=True)
    except (RecipeError, LayoutError, CheckpointError, DataError) as exc:
        print(f"elastor train: {exc}", file=sys.stderr)
        return 2
    if args.steps <= 0:
        print("elastor train: --steps must be positive", file=sys.stderr)
        return 2
    world = args.world_size or layout.world_size
    if world < layout.world_size:
        print(f"elastor train: --world-size {world} is smaller than the {layout.world_size} "
              f"ranks the layout uses", file=sys.stderr)
        return 2
    print(f"elastor train: {recipe.name} on {layout.num_gpus} of {world} ranks: "
          f"{layout.describe()}", flush=True)
    worker_args = ["--recipe", args.recipe, "--layout", args.layout,
                   "--steps", str(args.steps)]
    if args.seed is not None:
        worker_args += ["--seed", str(args.seed)]
    if args.metrics_out:
        worker_args += ["--metrics-out", args.metrics_out]
    if args.save:
        worker_args += ["--save", args.save, "--save-interval", str(args.save_interval),
                        "--keep-checkpoints", str(args.keep_checkpoints),
                        "--async-save" if args.async_save else "--no-async-save",
                        "--save-when-busy", args.save_when_busy,
                        "--on-save-error", args.on_save_error]
    if args.load:
        worker_args += ["--load", args.load]
    worker_args += ["--data-config", data.to_json()]
    result = run_torchrun(world, "elastor_mcore.runtime.worker", worker_args)
    if result.returncode:
        print(f"elastor train: a rank failed (exit code {result.returncode}); its error is "
              f"above", file=sys.stderr)
    return result.returncode
