"""The errors of the checkpoint package (a leaf: storage backends raise them too)."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint is missing, partial, corrupted, or does not fit the run."""


class StorageError(CheckpointError):
    """A storage request failed. ``transient``: the same request may succeed if repeated
    (a timeout, a dropped connection, an object store's 5xx, a short read); loads retry
    those (``storage.retrying``)."""

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient
