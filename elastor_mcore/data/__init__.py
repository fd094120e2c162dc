"""Real training data: JSON-lines corpora and Megatron indexed datasets.

One concern per module, lowest first (each imports only modules above it):

- ``errors``: ``DataError``, the one exception users see.
- ``tokenizer``: train and load the local byte-level BPE tokenizer.
- ``corpus``: find JSONL files, parse lines, report malformed ones by file and line.
- ``workers``: background worker processes (started with ``python -m``, so they never
  re-import the training script) and the pool that feeds them.
- ``doc_index``: the cached index of document offsets and token counts.
- ``packing``: the sample definition (documents joined by EOS, cut into samples).
- ``tasks``: what the background workers compute for training.
- ``indexed``: Megatron ``.bin``/``.idx`` datasets (read and build).
- ``prefetch``: the training-side source that stays ahead of the loop.
- ``config``: fail-fast checks of a ``DataConfig`` (defined, with its flags, in
  ``config/data.py``).
- ``prepare``: ``prepare_data``, run once by the launcher before any rank starts (no
  torch, so a launcher starts fast).
- ``source``: ``build_sample_source``, each rank's entry point.
- ``stdlib_corpus``: a demo corpus from the Python sources every machine has.

This package's ``__init__`` imports nothing, so a worker process stays light.
"""
