"""What data a run trains on (``DataConfig``) and its command-line flags, defined once.

The flags of ``elastor train`` and ``elastor launch`` come from the fields' metadata
(``config.flags``), with their defaults; the choice of source (``--data``,
``--data-path``, ``--synthetic-data``) sets two fields at once and is written here.
A rank receives the whole config as one JSON value (``RunSettings.data``). The checks
that read the corpus and the tokenizer are ``data.config.validate_data_config``.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

from elastor_mcore.config.flags import Command, Flags, setting

MalformedPolicy = Literal["skip", "fail"]
DataKind = Literal["synthetic", "jsonl", "indexed"]

COMMANDS: tuple[Command, ...] = ("train", "launch")
"""The commands that take the data flags."""


class DataFlagError(ValueError):
    """No data source was given where the command has no default."""


@dataclass(frozen=True, kw_only=True)
class DataConfig(Flags):
    """Where samples come from and how they are prepared (see docs/data.md)."""

    kind: DataKind = "synthetic"
    """Set by the source flags (``add_data_args``)."""
    paths: tuple[str, ...] = ()
    """JSONL files/directories (``jsonl``) or ``.bin``/``.idx`` prefixes (``indexed``)."""
    tokenizer: str | None = field(default=None, metadata=setting(
        "directory with tokenizer.json (from 'elastor tokenizer train'); required with "
        "--data and --data-path", COMMANDS, metavar="DIR"))
    malformed: MalformedPolicy = field(default="fail", metadata=setting(None, COMMANDS, consts=(
        ("--skip-malformed", "skip", "warn about malformed JSONL lines and skip them"),
        ("--fail-on-malformed", "fail", "stop at malformed JSONL lines (default)"))))
    workers: int = field(default=1, metadata=setting(
        "background tokenisation processes per rank (default %(default)s)", COMMANDS,
        flag="--data-workers", metavar="N"))
    """Background processes that tokenise and pack during training."""
    prefetch_depth: int = field(default=1024, metadata=setting(
        "samples prepared ahead of training per rank (default %(default)s)", COMMANDS,
        metavar="SAMPLES"))
    """Samples the background workers may have in flight ahead of training."""
    index_workers: int = field(default=0, metadata=setting(
        "processes that build the document index once (default: one per CPU)", COMMANDS,
        metavar="N"))
    """Processes that build the document index (0: one per CPU)."""
    cache_dir: str | None = field(default=None, metadata=setting(
        "where to cache the document index (default: .elastor-index beside the corpus)",
        COMMANDS, flag="--data-cache-dir", metavar="DIR"))
    shuffle: bool = field(default=False, metadata=setting(
        "shuffle document order per epoch (seeded by the run's seed: --seed, else the "
        "recipe's)", COMMANDS, flag="--shuffle-data", negatable=False))
    """Permute the documents of each epoch with a seed from (the run's seed, epoch)."""
    fingerprint: str | None = None
    """``prepare_data``'s fingerprint of the sample stream, set once by the launcher so
    that every rank records it in checkpoints and checks it on resume without indexing
    the corpus again (None: not known, nothing to compare)."""

    @property
    def index_processes(self) -> int:
        return self.index_workers or os.cpu_count() or 1

    def to_json(self) -> str:
        """One command-line value: how launchers hand the config to every rank."""
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> "DataConfig":
        data = json.loads(text)
        return DataConfig(**{**data, "paths": tuple(data["paths"])})

    def describe(self) -> str:
        if self.kind == "synthetic":
            return "synthetic tokens"
        return f"{self.kind} {' '.join(self.paths)} (tokenizer {self.tokenizer})"


def add_data_args(parser: argparse.ArgumentParser, command: Command) -> None:
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
    DataConfig.add_arguments(group, command)


def data_config_from_args(args: argparse.Namespace, command: Command,
                          default: DataConfig | None = None) -> DataConfig:
    """The DataConfig the flags describe; ``default`` when no data source flag is given
    (``DataFlagError`` if there is none)."""
    if args.synthetic_data:
        return DataConfig(kind="synthetic")
    if args.data:
        return replace(DataConfig.from_args(args, command), kind="jsonl", paths=tuple(args.data))
    if args.data_path:
        return replace(DataConfig.from_args(args, command), kind="indexed",
                       paths=tuple(args.data_path))
    if default is None:
        raise DataFlagError("no training data given: pass --data (JSONL corpus), --data-path "
                            "(Megatron indexed dataset) or --synthetic-data")
    return default
