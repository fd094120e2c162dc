"""What the background workers compute for training: packed samples and tokenised documents.

Tasks carry only small picklable descriptions (paths, seeds, index ranges); each worker
opens the tokenizer and the cached document index once and keeps them
(``WorkerContext.cached``), so its sequential tasks reuse recently tokenised documents.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from elastor_mcore.data.doc_index import JsonlDocuments, load_index
from elastor_mcore.data.packing import PackedSamples, PackingPlan
from elastor_mcore.data.tokenizer import load_tokenizer
from elastor_mcore.data.workers import WorkerContext


@dataclass(frozen=True)
class JsonlSpec:
    """Everything a process needs to produce the samples of a JSONL corpus."""

    index_path: str
    tokenizer_dir: str
    seq_length: int
    seed: int
    shuffle: bool


def open_jsonl_samples(spec: JsonlSpec) -> PackedSamples:
    """The packed samples of a corpus whose document index is already cached."""
    tokenizer = load_tokenizer(spec.tokenizer_dir)
    index = load_index(spec.index_path)
    plan = PackingPlan(index.token_counts, spec.seq_length, spec.seed, spec.shuffle)
    return PackedSamples(JsonlDocuments(index, tokenizer), plan, tokenizer.eos_id)


def to_ranges(indices: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Compress sample indices into ``(start, stop)`` runs of consecutive values."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return tuple((a, b) for a, b in runs)


@dataclass(frozen=True)
class SampleChunk:
    """A run of packed samples and what producing it cost."""

    tokens: np.ndarray          # int32 [samples, seq_length + 1]
    documents_tokenized: int
    tokens_tokenized: int
    seconds: float
    cpu_seconds: float   # below ``seconds`` when the machine is oversubscribed


def _packed(context: WorkerContext, spec: JsonlSpec) -> PackedSamples:
    return context.cached(spec, lambda: open_jsonl_samples(spec))


@dataclass(frozen=True)
class OpenTask:
    """Worker task: load the tokenizer and index now, so the first chunk is fast."""

    spec: JsonlSpec

    def run(self, context: WorkerContext) -> None:
        _packed(context, self.spec)


@dataclass(frozen=True)
class SampleTask:
    """Worker task: pack the samples listed by ``ranges`` (in that order)."""

    spec: JsonlSpec
    ranges: tuple[tuple[int, int], ...]

    def run(self, context: WorkerContext) -> SampleChunk:
        began, began_cpu = time.perf_counter(), time.process_time()
        packed = _packed(context, self.spec)
        documents, tokens = packed.documents_fetched, packed.tokens_fetched
        out = packed.samples([i for a, b in self.ranges for i in range(a, b)])
        return SampleChunk(out, packed.documents_fetched - documents,
                           packed.tokens_fetched - tokens, time.perf_counter() - began,
                           time.process_time() - began_cpu)


@dataclass(frozen=True)
class TokenizeTask:
    """Worker task: the tokens of documents ``[start, stop)`` of an indexed corpus."""

    index_path: str
    tokenizer_dir: str
    start: int
    stop: int

    def run(self, context: WorkerContext) -> list[np.ndarray]:
        store = context.cached(("documents", self.index_path, self.tokenizer_dir),
                               lambda: JsonlDocuments(load_index(self.index_path),
                                                      load_tokenizer(self.tokenizer_dir)))
        return store.documents(range(self.start, self.stop))
