"""Test worker: train several layouts one after another in one torchrun world.

Starting a world costs seconds per rank here (mcore imports), so the layout matrix
shares one. For each layout it writes ``<out>/<name>/metrics.json`` (reporting rank)
and ``<out>/<name>/rank<r>.pt``: every ShardedTensor this rank holds after the last
step, as ``{key: (global_offset, tensor)}``, from which the test rebuilds the full
weights.
"""

import argparse
import json
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from elastor_mcore.compat import cpu
from elastor_mcore.data import SyntheticTokens
from elastor_mcore.groups import GroupCache
from elastor_mcore.layout import load_layout
from elastor_mcore.recipe import load_recipe
from elastor_mcore.sharding import sharded_tensors
from elastor_mcore.train import setup_stage, train_steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--case", action="append", required=True,
                        help="NAME=LAYOUT:STEPS (layout: shorthand or YAML path)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    cpu.apply()
    dist.init_process_group("gloo")
    recipe = load_recipe(args.recipe)
    cache = GroupCache()
    for spec in args.case:
        name, rest = spec.split("=", 1)
        layout_spec, steps = rest.rsplit(":", 1)
        layout = load_layout(layout_spec, recipe)
        out = Path(args.out) / name
        out.mkdir(parents=True, exist_ok=True)
        runner = setup_stage(recipe, layout, recipe.training.seed, cache)
        if runner is None:
            continue
        source = SyntheticTokens(recipe.model.vocab_size, recipe.model.seq_length,
                                 recipe.training.seed)
        metrics = train_steps(runner, source, range(int(steps)))
        if metrics:
            (out / "metrics.json").write_text(json.dumps([m.__dict__ for m in metrics]))
        shards = {st.key: (tuple(st.global_offset), st.data.detach().clone())
                  for st in sharded_tensors(runner.model)}
        torch.save(shards, out / f"rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
