"""Test worker: one TP group of a first stage reading a corpus once.

Rank 0 reads the pipeline's samples through a real background source; every other
rank's source raises if asked, so the test learns that they only received. Each rank
writes the micro-batches of steps ``[0, --steps)`` to ``<out>/rank<r>.pt``.
"""

import argparse
from pathlib import Path

import torch
import torch.distributed as dist

from elastor_mcore.config.recipe import load_recipe
from elastor_mcore.config.data import DataConfig
from elastor_mcore.data.samples import pipeline_sample_indices, tp_shared_micro_batches
from elastor_mcore.data.source import build_sample_source
from elastor_mcore.parallel.layout import layout_from_dict


class Unread:
    """A source that must never be read: the TP group's first rank reads for it."""

    def sample(self, index: int) -> torch.Tensor:
        raise AssertionError(f"rank {dist.get_rank()} read sample {index} itself")

    def close(self) -> None:
        """Nothing to stop."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--data-config", required=True, type=DataConfig.from_json)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    recipe = load_recipe(args.recipe)
    training = recipe.training
    layout = layout_from_dict({"pipelines": [{
        "micro_batches": training.global_batch_size // training.micro_batch_size,
        "stages": [{"tp": dist.get_world_size(), "layers": recipe.model.num_layers}]}]})
    indices = pipeline_sample_indices(layout, 0, training.global_batch_size,
                                      training.micro_batch_size, 0, args.steps)
    source = build_sample_source(args.data_config, recipe, indices) if dist.get_rank() == 0 \
        else Unread()
    try:
        batches = [[(mb.tokens, mb.labels) for mb in tp_shared_micro_batches(
            source, layout, 0, step, training.global_batch_size, training.micro_batch_size,
            recipe.model.seq_length + 1, dist.group.WORLD, torch.device("cpu"))]
            for step in range(args.steps)]
    finally:
        source.close()
    torch.save(batches, Path(args.out) / f"rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
