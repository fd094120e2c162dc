"""Build a Megatron indexed dataset (PREFIX.bin / PREFIX.idx) from a JSONL corpus.

    python tools/build_indexed_dataset.py --data DIR_OR_FILES... --tokenizer DIR --out PREFIX

Documents are tokenised with the trained tokenizer by background workers and written
with megatron.core.datasets.indexed_dataset's builder, one sequence per document and
no EOS appended (training inserts it between documents), so `--data-path PREFIX`
trains on exactly the samples `--data` would. See docs/data.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastor_mcore.data.corpus import report_malformed, resolve_corpus  # noqa: E402
from elastor_mcore.data.doc_index import default_cache_dir, load_or_build_index  # noqa: E402
from elastor_mcore.data.errors import DataError  # noqa: E402
from elastor_mcore.data.indexed import build_indexed_dataset  # noqa: E402
from elastor_mcore.data.tokenizer import load_tokenizer  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", nargs="+", required=True, metavar="PATH",
                        help="JSONL files or directories of *.jsonl files")
    parser.add_argument("--tokenizer", required=True, metavar="DIR",
                        help="directory with tokenizer.json ('elastor tokenizer train')")
    parser.add_argument("--out", required=True, metavar="PREFIX",
                        help="output prefix: writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="tokenisation processes (default: one per CPU)")
    parser.add_argument("--skip-malformed", action="store_true",
                        help="skip malformed JSONL lines with a warning instead of stopping")
    parser.add_argument("--data-cache-dir", metavar="DIR",
                        help="where the document index is cached (default: beside the corpus)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="  %(message)s")
    began = time.monotonic()
    try:
        files = resolve_corpus(args.data)
        tokenizer = load_tokenizer(args.tokenizer)
        cache = Path(args.data_cache_dir) if args.data_cache_dir else default_cache_dir(args.data)
        print(f"indexing {len(files)} file(s) ({sum(f.size for f in files) / 1e6:.1f} MB)...",
              flush=True)
        index, _ = load_or_build_index(files, tokenizer, cache, args.workers)
        report_malformed(index.malformed, "skip" if args.skip_malformed else "fail")
        if index.num_documents == 0:
            raise DataError(f"the corpus {' '.join(args.data)} has no documents")
        print(f"writing {index.num_documents} documents, {index.num_tokens} tokens...", flush=True)
        build_indexed_dataset(index, tokenizer, args.out, args.workers)
    except DataError as exc:
        print(f"build_indexed_dataset: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}.bin and {args.out}.idx in {time.monotonic() - began:.1f} s; "
          f"train with --data-path {args.out} --tokenizer {args.tokenizer}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
