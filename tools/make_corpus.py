"""Write a JSONL demo corpus from the Python sources installed on this machine.

    python tools/make_corpus.py --out DIR [--max-mb N]

Nothing is downloaded: the standard library's sources come first, then the installed
packages'. See docs/data.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastor_mcore.data.stdlib_corpus import CorpusStats, write_stdlib_corpus  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for corpus-NNNNN.jsonl shards")
    parser.add_argument("--max-mb", type=float, default=16.0,
                        help="stop after about this many MB of JSONL (default 16)")
    args = parser.parse_args(argv)
    if args.max_mb <= 0:
        parser.error("--max-mb must be positive")
    began = time.monotonic()

    def progress(stats: CorpusStats) -> None:
        print(f"  {stats.files} source files, {stats.documents} documents, "
              f"{stats.bytes / 1e6:.1f} MB", flush=True)

    stats = write_stdlib_corpus(args.out, args.max_mb, progress)
    print(f"wrote {stats.documents} documents ({stats.bytes / 1e6:.1f} MB) from {stats.files} "
          f"source files into {args.out} in {time.monotonic() - began:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
