"""Each rank's sample source, from the data ``data.prepare`` made ready.

``build_sample_source`` gives a rank the ``SampleSource`` for the global sample indices
it will request, in order (``samples.pipeline_sample_indices``). The consumed position
recorded in a checkpoint is just the first index a restarted rank asks for: nothing
before it is read or tokenised.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import numpy as np
import torch

from elastor_mcore.config.data import DataConfig
from elastor_mcore.config.recipe import Recipe
from elastor_mcore.data.config import validate_data_config
from elastor_mcore.data.errors import DataError
from elastor_mcore.data.packing import PackedSamples
from elastor_mcore.data.prefetch import PrefetchedSamples
from elastor_mcore.data.prepare import indexed_samples, prepare_data
from elastor_mcore.data.samples import SampleSource, SyntheticTokens
from elastor_mcore.data.tasks import JsonlSpec

class PackedSampleSource:
    """A ``SampleSource`` computed in the calling process (indexed datasets: mmap reads).

    Each sample's ids are checked against the model's vocabulary, because a dataset
    built with another tokenizer than ``--tokenizer`` would otherwise fail deep inside
    the embedding lookup.
    """

    def __init__(self, packed: PackedSamples, vocab_size: int) -> None:
        self.packed = packed
        self.vocab_size = vocab_size

    def sample(self, index: int) -> torch.Tensor:
        row = self.packed.samples([index])[0]
        if row.max() >= self.vocab_size:
            raise DataError(
                f"sample {index} holds token id {row.max()} but the model's vocab_size is "
                f"{self.vocab_size}: the indexed dataset was made with another tokenizer than "
                f"--tokenizer; rebuild it with tools/build_indexed_dataset.py")
        return torch.from_numpy(row.astype(np.int64))

    def close(self) -> None:
        """Nothing runs in the background; present so every file-backed source closes alike."""

    def __enter__(self) -> "PackedSampleSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def build_sample_source(cfg: DataConfig, recipe: Recipe, indices: Iterable[int],
                        seed: int | None = None) -> SampleSource:
    """This rank's source of samples; ``indices`` are the global sample indices it will
    request, in order (JSONL workers prepare them ahead). ``seed`` is the run's
    (``RunSettings.seed_for``; None: the recipe's), which also initialises the weights.
    Close file-backed sources (``close()`` or ``with``) to stop their workers; synthetic
    data needs no closing."""
    seed = recipe.training.seed if seed is None else seed
    if cfg.kind == "synthetic":
        validate_data_config(cfg, recipe)
        return SyntheticTokens(recipe.model.vocab_size, recipe.model.seq_length, seed)
    if cfg.kind == "indexed":
        tokenizer = validate_data_config(cfg, recipe)
        return PackedSampleSource(indexed_samples(cfg, recipe, tokenizer, seed),
                                  recipe.model.vocab_size)
    summary = prepare_data(cfg, recipe)
    spec = JsonlSpec(summary.index_path, str(Path(cfg.tokenizer).resolve()),
                     recipe.model.seq_length, seed, cfg.shuffle)
    return PrefetchedSamples(spec, indices, cfg.prefetch_depth, cfg.workers)

