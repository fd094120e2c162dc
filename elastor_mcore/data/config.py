"""Fail-fast checks of what data a run trains on (``config.data.DataConfig``, whose
fields define the data flags).

``validate_data_config`` runs before any process starts: a missing or empty corpus, a
missing tokenizer, or a tokenizer larger than the model's vocabulary stops the
launch with a message that names the flag and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from elastor_mcore.config.data import DataConfig
from elastor_mcore.data.corpus import resolve_corpus
from elastor_mcore.data.errors import DataError

if TYPE_CHECKING:
    from elastor_mcore.config.recipe import Recipe
    from elastor_mcore.data.tokenizer import TextTokenizer


def validate_data_config(cfg: DataConfig, recipe: Recipe | None = None) -> TextTokenizer | None:
    """Check ``cfg`` (and, with a recipe, the tokenizer's vocabulary against the model's)
    without reading the corpus; returns the loaded tokenizer (None for synthetic data)."""
    if cfg.kind == "synthetic":
        return None
    if cfg.kind not in ("jsonl", "indexed"):
        raise DataError(f"unknown data kind {cfg.kind!r}; use synthetic, jsonl or indexed")
    for name, value, flag in (("prefetch_depth", cfg.prefetch_depth, "--prefetch-depth"),
                              ("workers", cfg.workers, "--data-workers")):
        if value < 1:
            raise DataError(f"{flag} must be at least 1, got {value}")
    if cfg.index_workers < 0:
        raise DataError(f"--index-workers must be 0 (one per CPU) or more, got {cfg.index_workers}")
    if cfg.malformed not in ("skip", "fail"):
        raise DataError(f"malformed-line policy {cfg.malformed!r}: use 'skip' or 'fail'")
    if cfg.kind == "jsonl":
        resolve_corpus(cfg.paths)
    else:
        if not cfg.paths:
            raise DataError("--data-path needs at least one dataset prefix")
        # Imported here: the indexed reader pulls in megatron.core, which JSONL runs skip.
        from elastor_mcore.data.indexed import check_indexed_prefix
        for prefix in cfg.paths:
            check_indexed_prefix(prefix)
    if cfg.tokenizer is None:
        flag = "--data" if cfg.kind == "jsonl" else "--data-path"
        raise DataError(f"{flag} needs --tokenizer DIR (train one with 'elastor tokenizer "
                        f"train --corpus ... --vocab-size N --out DIR')")
    from elastor_mcore.data.tokenizer import load_tokenizer  # numpy: after the cheap checks
    tokenizer = load_tokenizer(cfg.tokenizer)
    if recipe is not None and tokenizer.vocab_size > recipe.model.vocab_size:
        raise DataError(
            f"tokenizer {cfg.tokenizer} has {tokenizer.vocab_size} ids but the model's "
            f"vocab_size is {recipe.model.vocab_size}; train a tokenizer with --vocab-size "
            f"{recipe.model.vocab_size} or less, or raise model.vocab_size in the recipe")
    if cfg.cache_dir is not None and Path(cfg.cache_dir).exists() \
            and not Path(cfg.cache_dir).is_dir():
        raise DataError(f"--data-cache-dir {cfg.cache_dir} exists and is not a directory")
    return tokenizer
