"""JSON-lines corpora: which files, in which order, and what counts as a document.

A corpus is one or more ``.jsonl`` files (a directory stands for the ``*.jsonl`` files
directly inside it); the files are sorted by absolute path so the order never depends
on how they were listed. Each non-blank line is a JSON object with a string field
``"text"``; other fields are ignored. A line that is not is *malformed*: it is
reported as ``file:line: reason`` and either skipped or fatal (``MalformedPolicy``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from elastor_mcore.config.data import MalformedPolicy
from elastor_mcore.data.errors import DataError

log = logging.getLogger(__name__)

# How many malformed lines an error or warning spells out before summarising.
MALFORMED_SHOWN = 5


@dataclass(frozen=True)
class CorpusFile:
    """One corpus file and the stat fields that tell whether it changed."""

    path: str
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class MalformedLine:
    path: str
    line: int   # 1-based
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


def resolve_corpus(paths: Sequence[str | Path]) -> tuple[CorpusFile, ...]:
    """The corpus files named by ``paths`` (files or directories), sorted.

    Raises DataError for a missing path, a directory without ``*.jsonl`` files, or a
    corpus whose files are all empty: all before any worker starts.
    """
    if not paths:
        raise DataError("no corpus given: pass --data with JSONL files or directories")
    found: set[Path] = set()
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files = [p for p in path.glob("*.jsonl") if p.is_file()]
            if not files:
                raise DataError(f"corpus directory {path} contains no *.jsonl files")
            found.update(p.resolve() for p in files)
        elif path.is_file():
            found.add(path.resolve())
        else:
            raise DataError(f"corpus path {path} does not exist (--data takes JSONL files "
                            f"or directories of *.jsonl files)")
    corpus = []
    for path in sorted(found):
        stat = path.stat()
        corpus.append(CorpusFile(str(path), stat.st_size, stat.st_mtime_ns))
    if all(f.size == 0 for f in corpus):
        raise DataError(f"the corpus is empty: {', '.join(f.path for f in corpus)} "
                        f"{'has' if len(corpus) == 1 else 'have'} no bytes")
    return tuple(corpus)


def parse_document(line: bytes) -> str:
    """The text of one JSONL line; ValueError with the reason if it is malformed."""
    try:
        obj = json.loads(line)
    except UnicodeDecodeError:
        raise ValueError("not valid UTF-8") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f'expected a JSON object with a "text" field, got {type(obj).__name__}')
    text = obj.get("text")
    if not isinstance(text, str):
        raise ValueError('missing string field "text"')
    return text


@dataclass(frozen=True)
class ScannedRange:
    """The documents whose lines start in one byte range of a file."""

    offsets: list[int]          # byte offset of each document's line
    texts: list[str]
    malformed: list[tuple[int, str]]   # (0-based line within the range, reason)
    lines: int                  # lines that start in the range


def scan_range(path: str, start: int, end: int) -> ScannedRange:
    """Parse the lines of ``path`` that start at a byte offset in ``[start, end)``.

    Ranges can be scanned independently (in parallel) because a line belongs to the
    range its first byte falls in.
    """
    with open(path, "rb") as handle:
        if start > 0:
            handle.seek(start - 1)
            handle.readline()   # finish the line that started before ``start``
        first = handle.tell()
        data = handle.read(max(end - first, 0)) if first < end else b""
        if data and not data.endswith(b"\n"):
            data += handle.readline()
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    offsets, texts, malformed = [], [], []
    position = first
    for number, raw in enumerate(lines):
        if raw.strip():
            try:
                texts.append(parse_document(raw))
                offsets.append(position)
            except ValueError as exc:
                malformed.append((number, str(exc)))
        position += len(raw) + 1
    return ScannedRange(offsets, texts, malformed, len(lines))


def read_text(handle, offset: int) -> str:
    """The text of the document whose line starts at ``offset`` of an open file."""
    handle.seek(offset)
    return parse_document(handle.readline())


def iter_texts(files: Sequence[CorpusFile], policy: MalformedPolicy) -> Iterator[str]:
    """Every document's text in corpus order (used to train the tokenizer)."""
    bad: list[MalformedLine] = []
    for corpus_file in files:
        with open(corpus_file.path, "rb") as handle:
            for number, raw in enumerate(handle, start=1):
                if not raw.strip():
                    continue
                try:
                    yield parse_document(raw)
                except ValueError as exc:
                    bad.append(MalformedLine(corpus_file.path, number, str(exc)))
                    if policy == "fail":
                        report_malformed(bad, policy)
    report_malformed(bad, policy)


def report_malformed(bad: Sequence[MalformedLine], policy: MalformedPolicy) -> None:
    """Warn about (policy ``skip``) or raise on (policy ``fail``) malformed lines."""
    if not bad:
        return
    shown = "\n  ".join(str(b) for b in bad[:MALFORMED_SHOWN])
    more = f"\n  ... and {len(bad) - MALFORMED_SHOWN} more" if len(bad) > MALFORMED_SHOWN else ""
    if policy == "fail":
        raise DataError(
            f"{len(bad)} malformed corpus line(s) (each must be a JSON object with a string "
            f"\"text\" field):\n  {shown}{more}\nfix them, or pass --skip-malformed to skip them")
    log.warning("skipping %d malformed corpus line(s):\n  %s%s", len(bad), shown, more)
