"""``elastor tokenizer train``: learn a byte-level BPE from a JSONL corpus, offline."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Iterable, Iterator

from elastor_mcore.data.corpus import iter_texts, resolve_corpus
from elastor_mcore.data.errors import DataError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("tokenizer", help="train the corpus tokenizer")
    actions = parser.add_subparsers(dest="tokenizer_command", required=True)
    train = actions.add_parser(
        "train", help="train a byte-level BPE tokenizer on a JSONL corpus (no download)",
        description="Learn a byte-level BPE (tokenizers library) from the \"text\" fields of "
                    "a JSON-lines corpus and write DIR/tokenizer.json. The end-of-document "
                    "token <|endoftext|> is id 0.")
    train.add_argument("--corpus", nargs="+", required=True, metavar="PATH",
                       help="JSONL files or directories of *.jsonl files")
    train.add_argument("--vocab-size", type=int, required=True, metavar="N",
                       help="ids in the vocabulary, EOS included (at least 257; at most the "
                            "model's vocab_size)")
    train.add_argument("--out", required=True, metavar="DIR", help="output directory")
    train.add_argument("--max-mb", type=float, default=None, metavar="MB",
                       help="learn from the first MB megabytes of text only (default: all)")
    train.add_argument("--skip-malformed", action="store_true",
                       help="skip malformed lines with a warning instead of stopping")
    train.set_defaults(func=run_train)


def _first_megabytes(texts: Iterable[str], max_mb: float | None) -> Iterator[str]:
    """The texts up to about ``max_mb`` MB (all of them for None)."""
    budget = float("inf") if max_mb is None else max_mb * 1e6
    for text in texts:
        if budget <= 0:
            return
        budget -= len(text)
        yield text


def run_train(args: argparse.Namespace) -> int:
    from elastor_mcore.data.tokenizer import train_tokenizer  # numpy, tokenizers

    began = time.monotonic()
    try:
        files = resolve_corpus(args.corpus)
        texts = iter_texts(files, "skip" if args.skip_malformed else "fail")
        print(f"training a {args.vocab_size}-id BPE tokenizer on {len(files)} file(s), "
              f"{sum(f.size for f in files) / 1e6:.1f} MB"
              + (f" (first {args.max_mb:g} MB of text)" if args.max_mb else "") + " ...",
              flush=True)
        tokenizer = train_tokenizer(_first_megabytes(texts, args.max_mb), args.vocab_size, args.out,
                                    show_progress=sys.stderr.isatty())
    except DataError as exc:
        print(f"elastor tokenizer train: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {tokenizer.directory / 'tokenizer.json'}: {tokenizer.vocab_size} ids, "
          f"EOS id {tokenizer.eos_id}, in {time.monotonic() - began:.1f} s")
    return 0
