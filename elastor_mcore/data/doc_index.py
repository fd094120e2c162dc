"""The document index of a JSONL corpus: where each document starts and how many tokens it has.

Building it takes one tokenisation pass, split into byte ranges that the background
workers scan in parallel. It is cached as ``index-<key>.npz`` (beside the corpus by
default), where the key hashes every file's path, size and mtime and the tokenizer's
fingerprint, so a changed corpus or a retrained tokenizer gets a fresh index. With the
index, any sample position is found by arithmetic: resuming tokenises nothing that
is skipped. Concurrent ranks take a file lock, so one builds and the others load.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from elastor_mcore.data.corpus import CorpusFile, MalformedLine, read_text, scan_range
from elastor_mcore.data.errors import DataError
from elastor_mcore.data.tokenizer import TextTokenizer, load_tokenizer
from elastor_mcore.data.workers import WorkerContext, WorkerPool

log = logging.getLogger(__name__)

INDEX_VERSION = 1
CACHE_DIR_NAME = ".elastor-index"
# Bytes of corpus per scan task: big enough to amortise a task, small enough to balance.
SCAN_BYTES = 1 << 20


@dataclass(frozen=True)
class DocumentIndex:
    """Every document of a corpus, in corpus order (empty documents are left out)."""

    files: tuple[str, ...]
    file_ids: np.ndarray       # int32 [documents]: position in ``files``
    offsets: np.ndarray        # int64 [documents]: byte offset of the document's line
    token_counts: np.ndarray   # int32 [documents]: tokens, EOS not included
    malformed: tuple[MalformedLine, ...]
    path: str                  # the cache file it lives in

    @property
    def num_documents(self) -> int:
        return len(self.token_counts)

    @property
    def num_tokens(self) -> int:
        return int(self.token_counts.sum(dtype=np.int64))


def cache_key(files: Sequence[CorpusFile], tokenizer: TextTokenizer) -> str:
    payload = json.dumps({"version": INDEX_VERSION, "tokenizer": tokenizer.fingerprint,
                          "files": [[f.path, f.size, f.mtime_ns] for f in files]})
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


def default_cache_dir(paths: Sequence[str | Path]) -> Path:
    """Beside the corpus: ``<dir>/.elastor-index`` for the first ``--data`` path."""
    first = Path(paths[0])
    return (first if first.is_dir() else first.parent) / CACHE_DIR_NAME


def index_path(files: Sequence[CorpusFile], tokenizer: TextTokenizer, cache_dir: Path) -> Path:
    return cache_dir / f"index-{cache_key(files, tokenizer)}.npz"


def load_index(path: str | Path) -> DocumentIndex:
    """Read a cached index written by ``build_index``."""
    with np.load(path, allow_pickle=False) as data:
        files = tuple(str(f) for f in data["files"])
        malformed = tuple(MalformedLine(files[int(f)], int(n), str(r)) for f, n, r in zip(
            data["malformed_file"], data["malformed_line"], data["malformed_reason"]))
        return DocumentIndex(files=files, file_ids=data["file_ids"], offsets=data["offsets"],
                             token_counts=data["token_counts"], malformed=malformed,
                             path=str(path))


@dataclass(frozen=True)
class ScanTask:
    """Worker task: parse one byte range of a file and count each document's tokens."""

    path: str
    start: int
    end: int
    tokenizer_dir: str

    def run(self, context: WorkerContext) -> tuple[np.ndarray, np.ndarray, list, int]:
        tokenizer = context.cached(("tokenizer", self.tokenizer_dir),
                                   lambda: load_tokenizer(self.tokenizer_dir))
        scanned = scan_range(self.path, self.start, self.end)
        counts = tokenizer.count_tokens(scanned.texts)
        return np.array(scanned.offsets, dtype=np.int64), counts, scanned.malformed, scanned.lines


def build_index(files: Sequence[CorpusFile], tokenizer: TextTokenizer, path: Path,
                workers: int) -> DocumentIndex:
    """Scan and tokenise the whole corpus once with ``workers`` processes; save to ``path``."""
    tasks = [(file_id, ScanTask(f.path, start, min(start + SCAN_BYTES, f.size),
                                str(tokenizer.directory)))
             for file_id, f in enumerate(files) for start in range(0, f.size, SCAN_BYTES)]
    total_bytes = sum(f.size for f in files)
    log.info("building the document index of %d file(s), %.1f MB, with %d worker(s)",
             len(files), total_bytes / 1e6, workers)
    began = last_log = time.monotonic()
    file_ids, offsets, counts, malformed = [], [], [], []
    lines_before = [0] * len(files)
    done_bytes = 0
    with WorkerPool(min(workers, max(len(tasks), 1))) as pool:
        results = pool.imap(task for _, task in tasks)
        for (file_id, task), (doc_offsets, doc_counts, bad, lines) in zip(tasks, results):
            nonempty = doc_counts > 0
            offsets.append(doc_offsets[nonempty])
            counts.append(doc_counts[nonempty])
            file_ids.append(np.full(int(nonempty.sum()), file_id, dtype=np.int32))
            malformed += [MalformedLine(task.path, lines_before[file_id] + n + 1, reason)
                          for n, reason in bad]
            lines_before[file_id] += lines
            done_bytes += task.end - task.start
            now = time.monotonic()
            if now - last_log >= 5:
                last_log = now
                tokens = sum(int(c.sum(dtype=np.int64)) for c in counts)
                log.info("document index: %.0f%% of %.1f MB, %d tokens, %.0f tokens/s",
                         100 * done_bytes / total_bytes, total_bytes / 1e6, tokens,
                         tokens / (now - began))
    index = DocumentIndex(
        files=tuple(f.path for f in files),
        file_ids=np.concatenate(file_ids) if file_ids else np.zeros(0, np.int32),
        offsets=np.concatenate(offsets) if offsets else np.zeros(0, np.int64),
        token_counts=np.concatenate(counts) if counts else np.zeros(0, np.int32),
        malformed=tuple(malformed), path=str(path))
    _save(index)
    seconds = time.monotonic() - began
    log.info("document index built in %.1f s: %d documents, %d tokens (%.0f tokens/s), %s",
             seconds, index.num_documents, index.num_tokens, index.num_tokens / seconds, path)
    return index


def _save(index: DocumentIndex) -> None:
    path = Path(index.path)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, files=np.array(index.files), file_ids=index.file_ids, offsets=index.offsets,
             token_counts=index.token_counts,
             malformed_file=np.array([index.files.index(m.path) for m in index.malformed],
                                     dtype=np.int32),
             malformed_line=np.array([m.line for m in index.malformed], dtype=np.int64),
             malformed_reason=np.array([m.reason for m in index.malformed], dtype=str))
    tmp.replace(path)


def load_or_build_index(files: Sequence[CorpusFile], tokenizer: TextTokenizer, cache_dir: Path,
                        workers: int) -> tuple[DocumentIndex, bool]:
    """The corpus's index from the cache, built first if missing; and whether it was built."""
    path = index_path(files, tokenizer, cache_dir).resolve()   # workers read it by path
    if path.is_file():
        return load_index(path), False
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        lock = open(cache_dir / (path.name + ".lock"), "a")
    except OSError as exc:
        raise DataError(f"cannot write the document index into {cache_dir} ({exc.strerror}); "
                        f"pass --data-cache-dir with a writable directory") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # another rank may be building it right now
        if path.is_file():
            return load_index(path), False
        return build_index(files, tokenizer, path, workers), True


class JsonlDocuments:
    """A JSONL corpus as a document store: document ``d``'s tokens, read and tokenised on demand."""

    def __init__(self, index: DocumentIndex, tokenizer: TextTokenizer) -> None:
        self.index = index
        self.tokenizer = tokenizer
        self.token_counts = index.token_counts
        self._handles: dict[int, object] = {}

    def documents(self, ids: Sequence[int]) -> list[np.ndarray]:
        texts = []
        for doc in ids:
            file_id = int(self.index.file_ids[doc])
            if file_id not in self._handles:
                self._handles[file_id] = open(self.index.files[file_id], "rb")
            try:
                texts.append(read_text(self._handles[file_id], int(self.index.offsets[doc])))
            except ValueError as exc:
                raise self._stale(doc, str(exc)) from None
        tokens = self.tokenizer.encode_batch(texts)
        for doc, array in zip(ids, tokens):
            if len(array) != self.token_counts[doc]:
                raise self._stale(doc, f"{len(array)} tokens, the index says "
                                       f"{self.token_counts[doc]}")
        return tokens

    def _stale(self, doc: int, what: str) -> DataError:
        return DataError(
            f"{self.index.files[self.index.file_ids[doc]]} changed after its document index "
            f"{self.index.path} was built (document {doc}: {what}); delete the index to rebuild it")

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()
