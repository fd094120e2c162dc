"""A demo corpus from text every machine has: the Python sources of this interpreter.

The standard library comes first, then the installed packages (torch, Megatron-Core,
numpy... are dependencies of elastor, so they are there too), so no data is
downloaded or committed. Each source file is cut at definitions into
documents of a few kilobytes, like web documents, and written as JSONL shards
(``{"text": ..., "source": "relative/path.py"}``). The output is deterministic for a
given installation.
"""

from __future__ import annotations

import json
import logging
import os
import site
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from elastor_mcore.config.data import DataConfig
from elastor_mcore.data.corpus import iter_texts, resolve_corpus
from elastor_mcore.data.tokenizer import TOKENIZER_FILE, train_tokenizer
from elastor_mcore.config.recipe import Recipe

log = logging.getLogger(__name__)

DOCUMENT_BYTES = 4096
SHARD_BYTES = 16 << 20
# Definitions (top-level or methods) start a new document once the current one is full.
_BOUNDARIES = tuple(indent + start for indent in ("", "    ")
                    for start in ("def ", "class ", "async def ", "@")) + ("if __name__",)


@dataclass(frozen=True)
class CorpusStats:
    files: int
    documents: int
    bytes: int


def _source_roots() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    roots = [stdlib] + sorted({Path(p) for p in site.getsitepackages() if Path(p).is_dir()})
    return [r for r in roots if r.is_dir()]


def _python_files(root: Path, nested_packages: bool) -> Iterator[Path]:
    """``*.py`` under ``root`` in a fixed order (directories walked in sorted order,
    lazily, so a small corpus stops early); ``nested_packages=False`` leaves out the
    site-packages directories that sit inside the standard library's tree."""
    for directory, subdirs, names in os.walk(root):
        subdirs.sort()
        if not nested_packages:
            subdirs[:] = [d for d in subdirs if d not in ("site-packages", "dist-packages")]
        for name in sorted(names):
            if name.endswith(".py"):
                yield Path(directory) / name


def split_source(text: str) -> list[str]:
    """Cut a source file into documents at definitions, each about ``DOCUMENT_BYTES``
    (a single long definition stays whole)."""
    documents, current, size = [], [], 0
    for line in text.splitlines(keepends=True):
        if size >= DOCUMENT_BYTES and line.startswith(_BOUNDARIES):
            documents.append("".join(current))
            current, size = [], 0
        current.append(line)
        size += len(line)
    if current:
        documents.append("".join(current))
    return [d for d in documents if d.strip()]


def write_stdlib_corpus(out_dir: str | Path, max_mb: float,
                        progress: Callable[[CorpusStats], None] | None = None) -> CorpusStats:
    """Write up to ``max_mb`` MB of JSONL shards ``corpus-NNNNN.jsonl`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    limit = int(max_mb * 1e6)
    roots = _source_roots()
    files = documents = written = shard = 0
    handle = None
    try:
        for number, root in enumerate(roots):
            for path in _python_files(root, nested_packages=number > 0):
                try:
                    text = path.read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    continue
                relative = str(path.relative_to(root.parent))
                for document in split_source(text):
                    line = json.dumps({"text": document, "source": relative}) + "\n"
                    if handle is None or handle.tell() + len(line) > SHARD_BYTES:
                        if handle is not None:
                            handle.close()
                        handle = open(out / f"corpus-{shard:05d}.jsonl", "w", encoding="utf-8")
                        shard += 1
                    handle.write(line)
                    documents += 1
                    written += len(line.encode("utf-8"))
                files += 1
                if progress is not None and files % 500 == 0:
                    progress(CorpusStats(files, documents, written))
                if written >= limit:
                    return CorpusStats(files, documents, written)
        return CorpusStats(files, documents, written)
    finally:
        if handle is not None:
            handle.close()


def prepare_demo_data(work_dir: str | Path, recipe: Recipe, max_mb: float = 8.0) -> DataConfig:
    """A ready JSONL DataConfig for demos: the corpus and a tokenizer of the model's vocab
    size are made under ``work_dir`` the first time and reused afterwards."""
    work = Path(work_dir)
    corpus_dir, tokenizer_dir = work / "corpus", work / "tokenizer"
    if not any(corpus_dir.glob("*.jsonl")):
        log.info("writing a %.0f MB demo corpus from Python sources into %s", max_mb, corpus_dir)
        write_stdlib_corpus(corpus_dir, max_mb)
    if not (tokenizer_dir / TOKENIZER_FILE).is_file():
        log.info("training a %d-id tokenizer into %s", recipe.model.vocab_size, tokenizer_dir)
        train_tokenizer(iter_texts(resolve_corpus([corpus_dir]), "fail"),
                        recipe.model.vocab_size, tokenizer_dir)
    return DataConfig(kind="jsonl", paths=(str(corpus_dir),), tokenizer=str(tokenizer_dir))
