"""Entry points for the runtime: prepare the data once, then build each rank's sample source.

``prepare_data`` validates the configuration and builds (or loads) the document index;
call it in the launcher, before any worker process starts, so one process builds
the index and the ranks only load it. ``build_sample_source`` gives a rank the
``SampleSource`` for the global sample indices it will request, in order
(``samples.pipeline_sample_indices``). The consumed position recorded in a checkpoint is just
the first index a restarted rank asks for: nothing before it is read or tokenised.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch

from elastor_mcore.data.samples import SampleSource, SyntheticTokens
from elastor_mcore.config.data import DataConfig
from elastor_mcore.data.config import validate_data_config
from elastor_mcore.data.corpus import report_malformed, resolve_corpus
from elastor_mcore.data.doc_index import default_cache_dir, load_or_build_index
from elastor_mcore.data.errors import DataError
from elastor_mcore.data.packing import PackedSamples, PackingPlan
from elastor_mcore.data.prefetch import PrefetchedSamples
from elastor_mcore.data.tasks import JsonlSpec
from elastor_mcore.data.tokenizer import TextTokenizer
from elastor_mcore.parallel.layout import Layout
from elastor_mcore.config.recipe import Recipe

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataSummary:
    """What ``prepare_data`` found, for logs."""

    kind: str
    documents: int = 0
    tokens: int = 0
    samples_per_epoch: int = 0
    fingerprint: str = "synthetic"
    """Identifies the sample stream, not where the files are (a JSONL corpus and the
    indexed dataset built from it agree): ``<documents' token counts and shuffle>-
    <tokenizer file>``, so a resume can say which of the two changed
    (``fingerprint_change``). Checkpoints record it (``DataConfig.fingerprint``)."""
    index_path: str | None = None
    index_built: bool = False
    seconds: float = 0.0


def prepare_data(cfg: DataConfig, recipe: Recipe) -> DataSummary:
    """Validate ``cfg`` and make the corpus ready to sample (builds the index if missing).
    Nothing in the summary depends on the seed, which only orders shuffled epochs."""
    began = time.monotonic()
    tokenizer = validate_data_config(cfg, recipe)
    if cfg.kind == "synthetic":
        return DataSummary(kind="synthetic")
    if cfg.kind == "indexed":
        plan = _indexed_samples(cfg, recipe, tokenizer, recipe.training.seed).plan
        return DataSummary("indexed", len(plan.token_counts), int(plan.token_counts.sum()),
                           plan.samples_per_epoch, _fingerprint(plan, tokenizer),
                           seconds=time.monotonic() - began)
    files = resolve_corpus(cfg.paths)
    cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir(cfg.paths)
    index, built = load_or_build_index(files, tokenizer, cache_dir, cfg.index_processes)
    report_malformed(index.malformed, cfg.malformed)
    if index.num_documents == 0:
        raise DataError(f"the corpus {' '.join(cfg.paths)} has no documents (every line is "
                        f"blank, has an empty text, or is malformed)")
    plan = _plan(index.token_counts, cfg, recipe, recipe.training.seed)
    summary = DataSummary("jsonl", index.num_documents, index.num_tokens, plan.samples_per_epoch,
                          _fingerprint(plan, tokenizer), index.path, built,
                          time.monotonic() - began)
    log.info("data: %s", summary)
    return summary


def _fingerprint(plan: PackingPlan, tokenizer: TextTokenizer) -> str:
    digest = hashlib.sha256(plan.token_counts.astype(np.int64).tobytes())
    digest.update(f"{tokenizer.fingerprint} shuffle={plan.shuffle}".encode())
    return f"{digest.hexdigest()[:16]}-{tokenizer.fingerprint[:8]}"


def fingerprint_change(saved: str, now: str) -> str | None:
    """What differs between two ``DataSummary.fingerprint`` values, in words (None: same)."""
    if saved == now:
        return None
    if "synthetic" in (saved, now):
        return f"the data source changed from {_source_name(saved)} to {_source_name(now)}"
    saved_tokenizer, now_tokenizer = saved.rpartition("-")[2], now.rpartition("-")[2]
    if saved_tokenizer != now_tokenizer:
        return (f"the tokenizer changed (tokenizer.json {saved_tokenizer}... at save, "
                f"{now_tokenizer}... now)")
    return (f"the corpus changed: its documents' token counts differ (fingerprint {saved} at "
            f"save, {now} now): documents were edited, added, removed or reordered")


def _source_name(fingerprint: str) -> str:
    return "synthetic tokens" if fingerprint == "synthetic" else f"a corpus ({fingerprint})"


def _plan(token_counts: np.ndarray, cfg: DataConfig, recipe: Recipe, seed: int) -> PackingPlan:
    return PackingPlan(token_counts, recipe.model.seq_length, seed, cfg.shuffle)


def _indexed_samples(cfg: DataConfig, recipe: Recipe, tokenizer: TextTokenizer,
                     seed: int) -> PackedSamples:
    # Imported here: the indexed reader pulls in megatron.core, which JSONL runs skip.
    from elastor_mcore.data.indexed import IndexedDocuments
    store = IndexedDocuments(cfg.paths)
    return PackedSamples(store, _plan(store.token_counts, cfg, recipe, seed), tokenizer.eos_id)


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
        return PackedSampleSource(_indexed_samples(cfg, recipe, tokenizer, seed),
                                  recipe.model.vocab_size)
    summary = prepare_data(cfg, recipe)
    spec = JsonlSpec(summary.index_path, str(Path(cfg.tokenizer).resolve()),
                     recipe.model.seq_length, seed, cfg.shuffle)
    return PrefetchedSamples(spec, indices, cfg.prefetch_depth, cfg.workers)

