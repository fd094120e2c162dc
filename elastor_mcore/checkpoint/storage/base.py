"""The storage interface: what a backend offers the writer, the reader, the manager
and the lease. ``docs/checkpoint-format.md`` ("Writing a storage backend") states the
contract each method keeps; ``file`` and ``object_store`` are the two implementations.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Iterator, Protocol

MANIFEST = "manifest.json"
"""A directory's commit record: written last by ``commit_dir``, deleted first by
``remove``. A step without it is never loaded."""
TMP_PREFIX = ".tmp_"
"""Scratch entries a backend leaves beside a root's steps (a save in progress, a step
being deleted): never loaded, and deleted by the next save (``writer.remove_stale``)."""


class Location(Protocol):
    """A directory or file of a backend, used like a ``pathlib.Path`` (local files are
    plain ``Path`` objects). These few operations are all the callers use."""

    def __truediv__(self, name: str) -> "Location": ...
    @property
    def name(self) -> str: ...
    @property
    def parent(self) -> "Location": ...
    def resolve(self) -> "Location": ...
    def exists(self) -> bool: ...
    def is_file(self) -> bool: ...
    def is_dir(self) -> bool: ...
    def iterdir(self) -> Iterator["Location"]: ...
    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None: ...
    def read_bytes(self) -> bytes: ...
    def read_text(self, errors: str = "strict") -> str: ...
    def write_bytes(self, data: bytes) -> Any: ...
    def write_text(self, text: str) -> Any: ...
    def unlink(self, missing_ok: bool = False) -> None: ...


class Storage(ABC):
    """One backend: how bytes reach it, how a written directory becomes visible, how
    it is listed and deleted, and the primitives of the one-writer lease."""

    local_files: bool = False
    """Its locations are local files: the fast write and read paths apply, and ranks
    on one host share the page cache."""
    writes_in_place: bool = False
    """A save writes straight into its step directory, which only the manifest
    commits (no rename): an uncommitted ``step_N`` is a leftover of a failed save."""
    poll_s: float = 0.01
    """How often the committer of an asynchronous save looks for the writers' markers."""

    # ------------------------------------------------------------------ locations

    @abstractmethod
    def location(self, where: str) -> Location:
        """``where`` (a path or URL this backend serves) as a location."""

    @abstractmethod
    def kvstore(self, directory: Location) -> dict[str, Any]:
        """TensorStore's kvstore spec of ``directory`` (zarr arrays are opened on it)."""

    def local_path(self, directory: Location) -> Path:
        """``directory`` as a local path, for the fast paths (``local_files`` only)."""
        raise NotImplementedError(f"{type(self).__name__} offers no local files")

    # ------------------------------------------------------------------ commit protocol

    @abstractmethod
    def staging_dir(self, path: Location, token: str) -> Location:
        """Where a save of ``path`` writes before ``commit_dir`` makes it visible
        (``token`` tells one save's directory from an earlier, interrupted one's)."""

    @abstractmethod
    def commit_dir(self, tmp: Location, path: Location, manifest: str) -> None:
        """Make the fully written ``tmp`` visible as ``path`` (replacing any old one),
        its ``MANIFEST`` holding ``manifest``. Before this returns, a crash leaves
        ``path`` as it was or a leftover loaders ignore; after, every byte is durable."""

    @abstractmethod
    def write_durably(self, path: Location, data: str | bytes) -> None:
        """Write a small file that is either absent (or its old self), or present and
        complete, even across a crash."""

    @abstractmethod
    def write_marker(self, path: Location, text: str) -> None:
        """Best effort on a failing store: leave ``path`` (a rank's ``failed`` marker)
        even where ``text`` does not fit (a full disk)."""

    # ------------------------------------------------------------------ listing, deletion

    @abstractmethod
    def list_files(self, directory: Location) -> list[str]:
        """Every file below ``directory``, as paths relative to it."""

    @abstractmethod
    def stored_bytes(self, directory: Location) -> int | None:
        """Bytes stored below ``directory``; None where a listing gives no sizes."""

    @abstractmethod
    def remove(self, path: Location) -> None:
        """Delete a file or a directory tree (a directory's ``MANIFEST`` first, so it
        is never half a committed step); nothing if it is absent."""

    @abstractmethod
    def retire(self, path: Location) -> Location | None:
        """Make the committed ``path`` invisible at once (pruning), and return what is
        left to delete off the caller's path, if anything."""

    # ------------------------------------------------------------------ lease primitives

    @abstractmethod
    def prepare_root(self, root: Location) -> None:
        """Make ``root`` usable (create it, or check that it can be reached) or raise
        ``CheckpointError`` naming the problem, before a job takes its lease."""

    @abstractmethod
    def create_exclusive(self, path: Location, data: bytes) -> bool:
        """Create ``path`` holding ``data`` only if it does not exist; False if it did.
        Of two racing creators exactly one succeeds (where the store can tell)."""

    @abstractmethod
    def overwrite(self, path: Location, data: bytes) -> None:
        """Replace ``path`` so readers see the old or the new content, never a part."""

    @abstractmethod
    def remove_once(self, path: Location, claimant: str) -> None:
        """Delete ``path``; of racing removers (named by ``claimant``) one does it."""
