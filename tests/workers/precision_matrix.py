"""Test worker: train, save and resume layouts whose recipes differ in precision, in one
torchrun world.

Each ``--case NAME=LAYOUT:STEPS,recipe=PATH[,save=DIR][,load=DIR][,verify]`` works as
in ``train_matrix.py`` (whose case syntax and shard dumps it shares), except that every
case names its own recipe, so an fp32 checkpoint can be resumed in bf16 and back.
``metrics.json`` holds every step's loss and learning rate.
"""

import argparse
import json
import warnings
from pathlib import Path

import torch.distributed as dist

from elastor_mcore import checkpoint
from elastor_mcore.compat import cpu
from elastor_mcore.config.recipe import load_recipe
from elastor_mcore.data.samples import SyntheticTokens
from elastor_mcore.parallel.groups import GroupCache
from elastor_mcore.parallel.layout import load_layout
from elastor_mcore.runtime.state import chunk_policy, manifest_fields, state_shards
from elastor_mcore.runtime.train import resume, setup_stage, train_steps
from tests.workers.train_matrix import dump_shards, parse_case


def run_case(case: dict, cache: GroupCache, out_root: Path) -> None:
    recipe = load_recipe(case["recipe"])
    layout = load_layout(case["layout"], recipe)
    out = out_root / case["name"]
    out.mkdir(parents=True, exist_ok=True)
    seed = recipe.training.seed
    runner = setup_stage(recipe, layout, seed, cache)
    if runner is None:
        return
    start = resume(runner, case["load"], seed) if "load" in case else 0
    if "verify" in case:
        dump_shards(runner, out / f"loaded.rank{dist.get_rank()}.pt")
    source = SyntheticTokens(recipe.model.vocab_size, recipe.model.seq_length, seed)
    metrics = train_steps(runner, source, range(start, case["steps"]))
    if metrics:
        (out / "metrics.json").write_text(json.dumps([m.__dict__ for m in metrics]))
    if "save" in case:
        dump_shards(runner, Path(case["save"] + ".state") / f"rank{dist.get_rank()}.pt")
        checkpoint.save(case["save"], case["steps"], state_shards(runner.model, runner.optimizer),
                        manifest_fields(recipe, layout, case["steps"], seed, runner.optimizer),
                        group=runner.groups.active, chunking=chunk_policy(recipe))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--case", action="append", required=True)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    cpu.apply()
    dist.init_process_group("gloo")
    cache = GroupCache()
    for spec in args.case:
        run_case(parse_case(spec), cache, Path(args.out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
