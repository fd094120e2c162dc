"""The ``elastor`` command: one sub-command per module that owns the work.

Each sub-command module exposes ``register(subparsers)``, which adds its parser and
sets ``func`` to a callable taking the parsed arguments and returning an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys

SUBCOMMAND_MODULES = [
    "elastor_mcore.cli.train",
    "elastor_mcore.cli.tokenizer",
    "elastor_mcore.cli.inspect",
    "elastor_mcore.cli.convert",
    "elastor_mcore.cli.launch",
    "elastor_mcore.cli.demo",
    "elastor_mcore.cli.plan",
    "elastor_mcore.cli.profile",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elastor",
        description="Fault-tolerant Megatron-Core training on heterogeneous layouts.")
    parser.add_argument("--log-level", default="WARNING",
                        help="Python logging level for library messages (default WARNING)")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader left (``elastor inspect ... | head``): stop quietly, as a shell tool
        # killed by SIGPIPE does, and keep the interpreter's own flush at exit quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    return code

