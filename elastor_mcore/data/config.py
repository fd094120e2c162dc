"""The command-line flags of what data a run trains on (``DataConfig``, defined with
the other run settings in ``config.run``), and fail-fast checks.

``validate_data_config`` runs before any process starts: a missing or empty corpus, a
missing tokenizer, or a tokenizer larger than the model's vocabulary stops the
launch with a message that names the flag and the fix.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from elastor_mcore.config.run import DataConfig
from elastor_mcore.data.corpus import resolve_corpus
from elastor_mcore.data.errors import DataError

if TYPE_CHECKING:
    from elastor_mcore.config.recipe import Recipe
    from elastor_mcore.data.tokenizer import TextTokenizer


def add_data_args(parser: argparse.ArgumentParser) -> None:
    """Add the training-data flags (one group) to ``parser``."""
    group = parser.add_argument_group(
        "training data", "what to train on; see docs/data.md (default: set by the command)")
    source = group.add_mutually_exclusive_group()
    source.add_argument("--data", nargs="+", metavar="PATH",
                        help="JSON-lines corpus: .jsonl files and/or directories of them, one "
                             '{"text": ...} object per line; files are read in sorted order')
    source.add_argument("--data-path", nargs="+", metavar="PREFIX",
                        help="Megatron indexed dataset prefix(es) (PREFIX.bin + PREFIX.idx), "
                             "concatenated in the order given")
    source.add_argument("--synthetic-data", action="store_true",
                        help="train on seeded random tokens instead of a corpus")
    group.add_argument("--tokenizer", metavar="DIR",
                       help="directory with tokenizer.json (from 'elastor tokenizer train'); "
                            "required with --data and --data-path")
    malformed = group.add_mutually_exclusive_group()
    malformed.add_argument("--skip-malformed", dest="malformed", action="store_const",
                           const="skip", help="warn about malformed JSONL lines and skip them")
    malformed.add_argument("--fail-on-malformed", dest="malformed", action="store_const",
                           const="fail", help="stop at malformed JSONL lines (default)")
    group.add_argument("--data-workers", type=int, default=1, metavar="N",
                       help="background tokenisation processes per rank (default 1)")
    group.add_argument("--prefetch-depth", type=int, default=1024, metavar="SAMPLES",
                       help="samples prepared ahead of training per rank (default 1024)")
    group.add_argument("--index-workers", type=int, default=0, metavar="N",
                       help="processes that build the document index once (default: one "
                            "per CPU)")
    group.add_argument("--data-cache-dir", metavar="DIR",
                       help="where to cache the document index (default: .elastor-index "
                            "beside the corpus)")
    group.add_argument("--shuffle-data", action="store_true",
                       help="shuffle document order per epoch (seeded by the run's seed: --seed, "
                            "else the recipe's)")


def data_config_from_args(args: argparse.Namespace,
                          default: DataConfig | None = None) -> DataConfig:
    """The DataConfig the flags describe; ``default`` when no data source flag is given
    (DataError if there is none)."""
    common = dict(tokenizer=args.tokenizer, malformed=args.malformed or "fail",
                  prefetch_depth=args.prefetch_depth, workers=args.data_workers,
                  index_workers=args.index_workers, cache_dir=args.data_cache_dir,
                  shuffle=args.shuffle_data)
    if args.synthetic_data:
        return DataConfig(kind="synthetic")
    if args.data:
        return DataConfig(kind="jsonl", paths=tuple(args.data), **common)
    if args.data_path:
        return DataConfig(kind="indexed", paths=tuple(args.data_path), **common)
    if default is None:
        raise DataError("no training data given: pass --data (JSONL corpus), --data-path "
                        "(Megatron indexed dataset) or --synthetic-data")
    return default


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
