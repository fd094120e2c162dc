"""The training-side source of a JSONL corpus, kept ahead of the loop by background workers.

The rank says up front which global sample indices it will ask for, in order. They
are cut into chunks that the workers pack ahead of time; at most ``depth`` samples
(rounded up to whole chunks) are requested but not yet consumed, which bounds
memory, and a new chunk is requested whenever one is used up.

Warm-up: until every worker has started and loaded the tokenizer and index, the
training process packs the chunks it needs itself (a few documents; starting a
Python process can take longer than that), so a start or a restart never waits for
worker start-up. After that the loop only waits if the workers fall behind, which
``PrefetchStats`` counts. A request outside the announced order is still answered,
computed in the training process, so a wrong plan costs speed, never correctness.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np
import torch

from elastor_mcore.data.packing import PackedSamples
from elastor_mcore.data.tasks import (JsonlSpec, OpenTask, SampleTask, open_jsonl_samples,
                                          to_ranges)
from elastor_mcore.data.workers import WorkerPool

log = logging.getLogger(__name__)

# Tokens per chunk handed to a worker: large enough to amortise a round trip.
CHUNK_TOKENS = 16384
LOG_EVERY_SECONDS = 30.0


@dataclass
class PrefetchStats:
    """Counters of a ``PrefetchedSamples``."""

    samples_served: int = 0
    samples_packed_locally: int = 0
    """Samples the training process packed itself while the workers started."""
    samples_out_of_plan: int = 0
    chunks_from_workers: int = 0
    warmup_seconds: float = 0.0
    """From the source's creation to the first chunk the workers packed."""
    waits_after_warmup: int = 0
    wait_seconds_after_warmup: float = 0.0
    documents_tokenized: int = 0
    tokens_tokenized: int = 0
    """Documents and tokens tokenised for this source, here or by the workers."""
    worker_tokens: int = 0
    worker_seconds: float = 0.0
    worker_cpu_seconds: float = 0.0

    @property
    def tokens_per_worker_second(self) -> float:
        """Tokenisation throughput of one busy worker (wall clock)."""
        return self.worker_tokens / self.worker_seconds if self.worker_seconds else 0.0

    @property
    def tokens_per_worker_cpu_second(self) -> float:
        """The same per CPU second: what a worker does with a core to itself."""
        return self.worker_tokens / self.worker_cpu_seconds if self.worker_cpu_seconds else 0.0


def _chunks(indices: Iterator[int], size: int) -> Iterator[list[int]]:
    while chunk := list(itertools.islice(indices, size)):
        yield chunk


class PrefetchedSamples:
    """A ``SampleSource`` over a JSONL corpus whose samples are packed by worker processes.

    Use as a context manager, or call ``close()``, to stop the workers.
    """

    def __init__(self, spec: JsonlSpec, indices: Iterable[int], depth: int, workers: int) -> None:
        self.spec = spec
        self.stats = PrefetchStats()
        chunk = max(1, min(max(depth // 4, 1), CHUNK_TOKENS // (spec.seq_length + 1)))
        self._max_inflight = max(2, -(-depth // chunk))
        self._plan = _chunks(iter(indices), chunk)
        self._inflight: deque[tuple[int, list[int]]] = deque()
        self._current = np.zeros((0, spec.seq_length + 1), dtype=np.int32)
        self._current_indices: list[int] = []
        self._position = 0
        self._local: PackedSamples | None = None
        self._started = self._last_log = time.monotonic()
        self._pool = WorkerPool(workers)
        self._opening = [self._pool.submit(OpenTask(spec)) for _ in range(workers)]

    def poll_workers(self) -> bool:
        """Whether every worker has loaded the tokenizer and index (never waits); from
        then on the workers pack every further chunk."""
        if self._opening and all(self._pool.ready(t) for t in self._opening):
            for task_id in self._opening:
                self._pool.result(task_id)   # raises if a worker could not open the corpus
            self._opening = []
            self._top_up()
        return not self._opening

    def _top_up(self) -> None:
        while len(self._inflight) < self._max_inflight:
            chunk = next(self._plan, None)
            if chunk is None:
                return
            task = SampleTask(self.spec, to_ranges(chunk))
            self._inflight.append((self._pool.submit(task), chunk))

    def _packed_here(self, indices: list[int]) -> np.ndarray:
        """Pack samples in the training process (warm-up, or outside the plan)."""
        if self._local is None:
            self._local = open_jsonl_samples(self.spec)
        documents, tokens = self._local.documents_fetched, self._local.tokens_fetched
        out = self._local.samples(indices)
        self.stats.documents_tokenized += self._local.documents_fetched - documents
        self.stats.tokens_tokenized += self._local.tokens_fetched - tokens
        return out

    def _advance(self) -> None:
        """Make the next planned chunk current: packed here while the workers start,
        then the workers' (waiting for it if it is not ready)."""
        if self._opening:
            indices = next(self._plan, [])
            self._current, self._current_indices = self._packed_here(indices), indices
            self.stats.samples_packed_locally += len(indices)
        elif self._inflight:
            task_id, indices = self._inflight.popleft()
            ready = self._pool.ready(task_id)
            began = time.monotonic()
            chunk = self._pool.result(task_id)
            if not self.stats.chunks_from_workers:
                self.stats.warmup_seconds = time.monotonic() - self._started
            elif not ready:
                self.stats.waits_after_warmup += 1
                self.stats.wait_seconds_after_warmup += time.monotonic() - began
            self.stats.chunks_from_workers += 1
            self.stats.documents_tokenized += chunk.documents_tokenized
            self.stats.tokens_tokenized += chunk.tokens_tokenized
            self.stats.worker_tokens += chunk.tokens_tokenized
            self.stats.worker_seconds += chunk.seconds
            self.stats.worker_cpu_seconds += chunk.cpu_seconds
            self._current, self._current_indices = chunk.tokens, indices
            self._top_up()
        else:
            self._current_indices = []
        self._position = 0

    def sample(self, index: int) -> torch.Tensor:
        """Tokens of global sample ``index``: int64 ``[seq_length + 1]``."""
        self.poll_workers()
        if self._position == len(self._current_indices):
            self._advance()
        if self._position < len(self._current_indices) \
                and self._current_indices[self._position] == index:
            row = self._current[self._position]
            self._position += 1
            self.stats.samples_served += 1
        else:
            row = self._out_of_plan(index)
        if time.monotonic() - self._last_log >= LOG_EVERY_SECONDS:
            self._log_progress()
        return torch.from_numpy(row.astype(np.int64))

    def _out_of_plan(self, index: int) -> np.ndarray:
        if not self.stats.samples_out_of_plan:
            expected = (self._current_indices[self._position]
                        if self._position < len(self._current_indices) else "none (plan ended)")
            log.warning("sample %d was requested but %s was planned next; computing samples "
                        "outside the plan in the training process (slow)", index, expected)
        self.stats.samples_out_of_plan += 1
        return self._packed_here([index])[0]

    def _log_progress(self) -> None:
        self._last_log = time.monotonic()
        ahead = len(self._current_indices) - self._position + sum(
            len(c) for _, c in self._inflight)
        log.info("data: %d samples served, %d planned ahead, workers tokenised %d tokens at "
                 "%.0f tokens/s each, %d wait(s) after warm-up (%.2f s)",
                 self.stats.samples_served, ahead, self.stats.worker_tokens,
                 self.stats.tokens_per_worker_second, self.stats.waits_after_warmup,
                 self.stats.wait_seconds_after_warmup)

    def close(self) -> None:
        """Stop the workers; the source cannot be used afterwards."""
        self._pool.close()
        if self._local is not None:
            self._local.store.close()

    def __enter__(self) -> "PrefetchedSamples":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
