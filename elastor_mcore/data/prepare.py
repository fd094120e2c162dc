"""Make the data ready before any rank starts: validate the configuration, build (or
load) the document index, and fingerprint the sample stream.

The launchers (``elastor train``, ``elastor launch``, ``elastor demo``) call
``prepare_data`` once, so one process builds the index and the ranks only load it. It
needs numpy and the tokenizer but not torch: a launcher that only prepares data starts
in a fraction of a second (``data.source`` builds the ranks' torch sample sources).
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from elastor_mcore.config.data import DataConfig
from elastor_mcore.config.recipe import Recipe
from elastor_mcore.data.config import validate_data_config
from elastor_mcore.data.corpus import report_malformed, resolve_corpus
from elastor_mcore.data.doc_index import default_cache_dir, load_or_build_index
from elastor_mcore.data.errors import DataError
from elastor_mcore.data.packing import PackedSamples, PackingPlan
from elastor_mcore.data.tokenizer import TextTokenizer

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
        plan = indexed_samples(cfg, recipe, tokenizer, recipe.training.seed).plan
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


def _plan(token_counts: np.ndarray, cfg: DataConfig, recipe: Recipe, seed: int
          ) -> PackingPlan:
    return PackingPlan(token_counts, recipe.model.seq_length, seed, cfg.shuffle)


def indexed_samples(cfg: DataConfig, recipe: Recipe, tokenizer: TextTokenizer,
                    seed: int) -> PackedSamples:
    """The packed samples of an indexed dataset (``cfg.kind == "indexed"``)."""
    # Imported here: the indexed reader pulls in megatron.core, which JSONL runs skip.
    from elastor_mcore.data.indexed import IndexedDocuments
    store = IndexedDocuments(cfg.paths)
    return PackedSamples(store, _plan(store.token_counts, cfg, recipe, seed),
                         tokenizer.eos_id)
