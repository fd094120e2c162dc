"""``elastor train``: validate a recipe and layout, then run them under torchrun."""

from __future__ import annotations

import argparse
import sys

from elastor_mcore.launch import run_torchrun
from elastor_mcore.layout import LayoutError, load_layout
from elastor_mcore.recipe import RecipeError, load_recipe


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
                        help="write JSON lines {step, loss, grad_norm, time_s} here")
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks to start (default: the layout's); extra ranks stay idle")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        recipe = load_recipe(args.recipe)
        layout = load_layout(args.layout, recipe)
    except (RecipeError, LayoutError) as exc:
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
    result = run_torchrun(world, "elastor_mcore.worker", worker_args)
    if result.returncode:
        print(f"elastor train: a rank failed (exit code {result.returncode}); its error is "
              f"above", file=sys.stderr)
    return result.returncode
