"""A byte-level BPE tokenizer trained locally with the ``tokenizers`` library.

Nothing is ever downloaded: ``train_tokenizer`` learns the merges from the corpus and
writes ``tokenizer.json`` into a directory, and ``load_tokenizer`` reads it back. The
SHA-256 of that file is the tokenizer's fingerprint, which keys the document-index
cache so that a retrained tokenizer never reuses stale token counts.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from elastor_mcore.data.errors import DataError

TOKENIZER_FILE = "tokenizer.json"
EOS_TOKEN = "<|endoftext|>"
# End-of-document tokens recognised in tokenizers not trained here.
EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<eos>", "<|end_of_text|>")
# 256 byte symbols plus the end-of-document token.
MIN_VOCAB_SIZE = 257


class TextTokenizer:
    """A loaded tokenizer: text to int32 ids, plus its EOS id, vocab size and fingerprint."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory).resolve()
        path = self.directory / TOKENIZER_FILE
        if not path.is_file():
            raise DataError(
                f"tokenizer directory {self.directory} has no {TOKENIZER_FILE}; train one with "
                f"'elastor tokenizer train --corpus ... --vocab-size N --out {self.directory}'")
        raw = path.read_bytes()
        try:
            self._tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as exc:  # the Rust side raises a plain Exception
            raise DataError(f"{path} is not a valid tokenizers file: {exc}") from None
        self.fingerprint = hashlib.sha256(raw).hexdigest()
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        eos = [self._tokenizer.token_to_id(t) for t in EOS_CANDIDATES]
        eos = [i for i in eos if i is not None]
        if not eos:
            raise DataError(
                f"{path} has no end-of-document token (looked for {', '.join(EOS_CANDIDATES)}); "
                f"documents are separated by one, so add it as a special token or retrain")
        self.eos_id = eos[0]

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids of each text (no special tokens added), as int32 arrays."""
        encodings = self._tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    def count_tokens(self, texts: Sequence[str]) -> np.ndarray:
        """How many ids each text encodes to (int32), without building the id arrays."""
        encodings = self._tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)
        return np.fromiter((len(e) for e in encodings), dtype=np.int32, count=len(encodings))


def load_tokenizer(directory: str | Path) -> TextTokenizer:
    """Load the tokenizer saved in ``directory``; DataError says how to make one."""
    if not Path(directory).is_dir():
        raise DataError(
            f"tokenizer directory {directory} does not exist; train one with "
            f"'elastor tokenizer train --corpus ... --vocab-size N --out {directory}'")
    return TextTokenizer(directory)


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | Path,
                    show_progress: bool = False) -> TextTokenizer:
    """Learn a byte-level BPE of ``vocab_size`` ids (EOS included) from ``texts``.

    Byte-level means every string is encodable, so no unknown token is needed and the
    vocabulary can be as small as 257. ``show_progress`` draws the library's progress
    bars on the terminal (for command-line use).
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise DataError(
            f"--vocab-size {vocab_size} is too small: a byte-level BPE needs at least "
            f"{MIN_VOCAB_SIZE} ids (256 bytes + the end-of-document token)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=show_progress)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (TOKENIZER_FILE + ".tmp")
    tokenizer.save(str(tmp))
    tmp.replace(out / TOKENIZER_FILE)
    return TextTokenizer(out)
