"""The sample definition: documents joined by EOS and cut into fixed-length samples.

Within epoch ``e`` the documents are laid end to end, each followed by one EOS token,
in corpus order (or, with ``shuffle``, in a permutation drawn from ``(seed, e)``).
Sample ``j`` of the epoch is tokens ``[j*S, j*S + S + 1)`` of that stream, where
``S = seq_length``: consecutive samples overlap by one token, so every token but the
first is a label exactly once (Megatron's GPT convention). An epoch holds
``(T - 1) // S`` samples for ``T`` stream tokens; global sample ``i`` is sample
``i % N`` of epoch ``i // N``. Everything depends only on ``i``, the token counts and
the seed, never on the layout or the restart, and a sample is located by a binary
search over cumulative counts, touching only the documents it overlaps.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol, Sequence

import numpy as np

from elastor_mcore.data.errors import DataError

# Tokens of recently used documents kept per process (a document usually spans many
# consecutive samples).
DOCUMENT_CACHE_TOKENS = 1 << 22


class DocumentStore(Protocol):
    """Documents by position: their token counts, and their tokens on demand."""

    token_counts: np.ndarray

    def documents(self, ids: Sequence[int]) -> list[np.ndarray]:
        ...


class PackingPlan:
    """Where every sample's tokens come from, computed from token counts alone."""

    def __init__(self, token_counts: np.ndarray, seq_length: int, seed: int,
                 shuffle: bool) -> None:
        self.token_counts = np.asarray(token_counts, dtype=np.int64)
        self.seq_length = seq_length
        self.seed = seed
        self.shuffle = shuffle
        stream = int(self.token_counts.sum()) + len(self.token_counts)
        self.samples_per_epoch = max(stream - 1, 0) // seq_length
        if self.samples_per_epoch == 0:
            raise DataError(
                f"the corpus has {stream} tokens (EOS included), fewer than one sample of "
                f"seq_length + 1 = {seq_length + 1}; use a bigger corpus")
        self._epochs: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Document order of an epoch and the stream position where each one ends."""
        if epoch not in self._epochs:
            if self.shuffle:
                rng = np.random.default_rng([self.seed, epoch])
                order = rng.permutation(len(self.token_counts))
            else:
                order = np.arange(len(self.token_counts))
            self._epochs[epoch] = (order, np.cumsum(self.token_counts[order] + 1))
            if len(self._epochs) > 2:
                self._epochs.popitem(last=False)
        return self._epochs[epoch]

    def pieces(self, index: int) -> list[tuple[int, int, int]]:
        """Sample ``index`` as ``(document, start, stop)`` slices of each document's
        tokens-plus-EOS, in order; ``stop`` may be ``count + 1`` (the EOS)."""
        if index < 0:
            raise IndexError(f"sample index {index} is negative")
        epoch, within = divmod(index, self.samples_per_epoch)
        order, ends = self._epoch(epoch)
        first = within * self.seq_length
        last = first + self.seq_length + 1
        out = []
        k = int(np.searchsorted(ends, first, side="right"))
        while True:
            doc = int(order[k])
            length = int(self.token_counts[doc]) + 1
            start = int(ends[k]) - length
            out.append((doc, max(first - start, 0), min(last - start, length)))
            if ends[k] >= last:
                return out
            k += 1


class PackedSamples:
    """Samples as token arrays, fetching each needed document from a store once."""

    def __init__(self, store: DocumentStore, plan: PackingPlan, eos_id: int) -> None:
        self.store = store
        self.plan = plan
        self.eos_id = eos_id
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._cached_tokens = 0
        self.documents_fetched = 0
        self.tokens_fetched = 0

    def samples(self, indices: Sequence[int]) -> np.ndarray:
        """int32 ``[len(indices), seq_length + 1]``: the tokens of each sample."""
        layout = [self.plan.pieces(i) for i in indices]
        needed = dict.fromkeys(doc for pieces in layout for doc, _, _ in pieces)
        tokens = {doc: self._cache[doc] for doc in needed if doc in self._cache}
        missing = [doc for doc in needed if doc not in tokens]
        if missing:
            tokens.update(zip(missing, self.store.documents(missing)))
            self.documents_fetched += len(missing)
            self.tokens_fetched += int(self.plan.token_counts[missing].sum())
        for doc in needed:
            self._remember(doc, tokens[doc])
        out = np.empty((len(indices), self.plan.seq_length + 1), dtype=np.int32)
        for row, pieces in zip(out, layout):
            at = 0
            for doc, start, stop in pieces:
                body = tokens[doc][start:min(stop, len(tokens[doc]))]
                row[at:at + len(body)] = body
                at += len(body)
                if stop > len(tokens[doc]):
                    row[at] = self.eos_id
                    at += 1
        return out

    def _remember(self, doc: int, tokens: np.ndarray) -> None:
        """Keep ``doc`` as the most recently used document, evicting the oldest."""
        if doc in self._cache:
            self._cache.move_to_end(doc)
            return
        self._cache[doc] = tokens
        self._cached_tokens += len(tokens)
        while self._cached_tokens > DOCUMENT_CACHE_TOKENS and len(self._cache) > 1:
            _, dropped = self._cache.popitem(last=False)
            self._cached_tokens -= len(dropped)
