"""Where checkpoints live: one interface (``Storage``), an implementation per backend.

``storage_for(where)`` is the one place a path or URL picks its backend: a URL's
scheme names one (``s3://``, ``gs://``: ``object_store``), anything else is a local
path (``file``). Each backend owns its commit protocol, listing, deletion and the
lease's primitives; the callers (writer, reader, manager, lease) use only the
interface and the ``Location`` operations. A new backend is one module with a
``Storage`` subclass, registered for its scheme with ``register``
(docs/checkpoint-format.md, "Writing a storage backend").

Loads retry transient storage errors here, once for every backend (``retrying``).
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import itertools
import os
import re
import time
from typing import IO, Callable, Iterator, TypeVar

from elastor_mcore.checkpoint.errors import CheckpointError, StorageError
from elastor_mcore.checkpoint.storage.base import MANIFEST, TMP_PREFIX, Location, Storage
from elastor_mcore.checkpoint.storage.file import FileStorage
from elastor_mcore.checkpoint.storage.object_store import ObjectStorage

__all__ = ["MANIFEST", "TMP_PREFIX", "Location", "Storage", "as_path", "is_url",
           "open_location", "register", "retrying", "storage_for"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_FILES = FileStorage()
_BY_SCHEME: dict[str, Storage] = {"s3": ObjectStorage(), "gs": ObjectStorage()}

READ_ATTEMPTS = 5
"""Tries of one load request before a transient error is reported."""
FIRST_BACKOFF_S = 0.1
"""Wait before the second try; each later wait doubles (0.1 + 0.2 + 0.4 + 0.8 s)."""
_TRANSIENT_ERRNOS = {errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT, errno.ECONNRESET,
                     errno.ECONNABORTED, errno.EBUSY}


def register(scheme: str, storage: Storage) -> None:
    """Serve ``scheme://...`` locations with ``storage`` (a new backend)."""
    if not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme):
        raise ValueError(f"{scheme!r} is not a URL scheme (lower-case letters, digits, "
                         f"'+', '.', '-')")
    _BY_SCHEME[scheme] = storage


def storage_for(where: str | os.PathLike | Location) -> Storage:
    """The backend of a path, a URL or a location."""
    text = os.fspath(where) if isinstance(where, os.PathLike) else str(where)
    scheme, sep, _ = text.partition("://")
    if not sep:
        return _FILES
    try:
        return _BY_SCHEME[scheme]
    except KeyError:
        raise CheckpointError(
            f"{text!r}: no storage backend serves {scheme}:// URLs; use a local path or "
            f"one of {', '.join(f'{s}://' for s in sorted(_BY_SCHEME))}") from None


def as_path(where: str | os.PathLike | Location) -> Location:
    """``where`` as its backend's location (a ``pathlib.Path`` for local files)."""
    if not isinstance(where, (str, os.PathLike)):
        return where
    return storage_for(where).location(os.fspath(where))


def is_url(where: str | os.PathLike | Location) -> bool:
    """Whether ``where`` names a store other than local files (an ``s3://`` URL)."""
    return not storage_for(where).local_files


@contextlib.contextmanager
def open_location(where: str | os.PathLike | Location, mode: str = "r") -> Iterator[IO]:
    """``open`` for a small file on any backend (a tracker file): reading is one read,
    writing one durable write when the block ends (readers see the old file or the new)."""
    path = as_path(where)
    if mode not in ("r", "rb", "w", "wb"):
        raise ValueError(f"open_location({str(path)!r}, {mode!r}): only r, rb, w and wb")
    binary = "b" in mode
    if mode.startswith("r"):
        data = path.read_bytes()
        yield io.BytesIO(data) if binary else io.StringIO(data.decode())
        return
    buffer = io.BytesIO() if binary else io.StringIO()
    yield buffer
    storage_for(path).write_durably(path, buffer.getvalue())


def is_transient(exc: BaseException) -> bool:
    """Whether the request that raised ``exc`` may succeed if repeated."""
    if isinstance(exc, StorageError):
        return exc.transient
    return isinstance(exc, (TimeoutError, ConnectionError)) or (
        isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS)


def retrying(request: Callable[[], T], what: str) -> T:
    """``request()`` (a load's storage reads), tried again after a transient error,
    ``READ_ATTEMPTS`` times at most with doubling waits. A permanent error, or a
    transient one that outlasts the tries, raises ``CheckpointError`` naming ``what``
    (the object) and the fix; one the storage already explained passes as it is."""
    wait = FIRST_BACKOFF_S
    for attempt in itertools.count(1):
        try:
            return request()
        except Exception as exc:  # classified below; anything else is not storage's
            if not isinstance(exc, (OSError, CheckpointError)):
                raise
            if not is_transient(exc):
                if isinstance(exc, CheckpointError):
                    raise
                raise CheckpointError(f"{what} failed: {_permanent_fix(exc)} ({exc})") from exc
            if attempt == READ_ATTEMPTS:
                raise CheckpointError(
                    f"{what} failed {attempt} times, the last with {type(exc).__name__}: "
                    f"{exc}; the storage keeps failing: check its health (the disk or mount, "
                    f"the object store's endpoint and the network), then load again") from exc
            log.warning("%s failed (%s: %s); retrying in %.1fs (try %d of %d)", what,
                        type(exc).__name__, exc, wait, attempt + 1, READ_ATTEMPTS)
            time.sleep(wait)
            wait *= 2


def _permanent_fix(exc: BaseException) -> str:
    if isinstance(exc, FileNotFoundError):
        return ("it does not exist: it was deleted (pruned by a job saving into this "
                "root?) or the path is wrong; load another step or the root")
    if isinstance(exc, PermissionError):
        return "permission denied: give this user read access, or load from elsewhere"
    return "the storage refused it; check the storage, or load another step"
