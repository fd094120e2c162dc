"""Megatron indexed datasets (``PREFIX.bin`` / ``PREFIX.idx``), read and written through
``megatron.core.datasets.indexed_dataset``.

Each sequence of the dataset is one document, and the same packing as for JSONL
applies (``packing``): documents joined by the tokenizer's EOS, so a dataset built
from a JSONL corpus with ``build_indexed_dataset`` yields exactly the samples of that
corpus. Build such datasets without an end-of-document token in the documents (our
builder does; for Megatron's ``preprocess_data.py`` leave out ``--append-eod``).
Reads are memory-mapped and need no tokenisation, so this source runs in the
training process with no background workers.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Sequence

import numpy as np
from megatron.core.datasets.indexed_dataset import (DType, IndexedDataset, IndexedDatasetBuilder,
                                                    get_bin_path, get_idx_path)

from elastor_mcore.data.doc_index import DocumentIndex
from elastor_mcore.data.errors import DataError
from elastor_mcore.data.tasks import TokenizeTask
from elastor_mcore.data.tokenizer import TextTokenizer
from elastor_mcore.data.workers import WorkerPool

log = logging.getLogger(__name__)

# Documents per tokenisation task while building a dataset.
BUILD_DOCUMENTS_PER_TASK = 512


def check_indexed_prefix(prefix: str) -> None:
    """Raise DataError unless both files of an indexed dataset exist."""
    missing = [p for p in (get_bin_path(prefix), get_idx_path(prefix)) if not Path(p).is_file()]
    if missing:
        raise DataError(
            f"--data-path {prefix}: missing {' and '.join(missing)}; give the prefix without "
            f"the extension, or build the dataset with tools/build_indexed_dataset.py")


class IndexedDocuments:
    """One or more indexed datasets, concatenated in order, as a document store."""

    def __init__(self, prefixes: Sequence[str]) -> None:
        for prefix in prefixes:
            check_indexed_prefix(prefix)
        self.datasets = [IndexedDataset(prefix, mmap=True) for prefix in prefixes]
        lengths = [np.asarray(d.sequence_lengths, dtype=np.int64) for d in self.datasets]
        self.token_counts = np.concatenate(lengths)
        self._starts = np.cumsum([0] + [len(x) for x in lengths])
        if not len(self.token_counts) or not self.token_counts.sum():
            raise DataError(f"indexed dataset(s) {', '.join(prefixes)} hold no tokens")

    def documents(self, ids: Sequence[int]) -> list[np.ndarray]:
        out = []
        for doc in ids:
            which = int(np.searchsorted(self._starts, doc, side="right")) - 1
            out.append(np.asarray(self.datasets[which][doc - int(self._starts[which])],
                                  dtype=np.int32))
        return out


def build_indexed_dataset(index: DocumentIndex, tokenizer: TextTokenizer, prefix: str | Path,
                          workers: int) -> None:
    """Write the documents of an indexed JSONL corpus as ``prefix.bin``/``prefix.idx``,
    one sequence (and one Megatron document) per corpus document, no EOS appended."""
    prefix = str(prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=dtype)
    began = last_log = time.monotonic()
    tasks = (TokenizeTask(index.path, str(tokenizer.directory), start,
                          min(start + BUILD_DOCUMENTS_PER_TASK, index.num_documents))
             for start in range(0, index.num_documents, BUILD_DOCUMENTS_PER_TASK))
    done = 0
    with WorkerPool(workers) as pool:
        for documents in pool.imap(tasks):
            for tokens in documents:
                builder.add_document(tokens, [len(tokens)])
            done += len(documents)
            if time.monotonic() - last_log >= 5:
                last_log = time.monotonic()
                log.info("indexed dataset: %d of %d documents", done, index.num_documents)
    builder.finalize(get_idx_path(prefix))
    log.info("wrote %s.bin/.idx: %d documents, %d tokens, %s, in %.1f s", prefix,
             index.num_documents, index.num_tokens, np.dtype(dtype).name,
             time.monotonic() - began)

