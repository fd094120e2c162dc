"""A storage backend that fails on purpose, in front of a real one (files, or the
local S3 server).

``FaultyStorage(inner, faults)`` serves ``faulty://<inner path or URL>`` (registered
with ``checkpoint.storage.register``), passing every request to ``inner`` except a
share of them, drawn from a seeded RNG, which it fails instead:

* ``fail``: the request raises ``ConnectionResetError`` before reaching the store;
* ``timeout``: it hangs ``timeout_s`` and raises ``TimeoutError``; a write has gone
  through by then (its reply is what was lost), a read has not;
* ``short``: a read returns the first half of the bytes (other requests fail).

Requests are the ``Storage`` methods (commit, durable writes, markers, listings,
deletions, the fast path's access to local files) and the ``Location`` operations
(``exists``, ``is_file``, ``iterdir``, reads, writes, ``unlink``, ``mkdir``).
TensorStore's own requests for array data go straight to the inner store. Names in
``Faults.denied`` fail every time with ``PermissionError`` (a permanent error).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, TypeVar

from elastor_mcore.checkpoint.storage import Location, Storage, storage_for

SCHEME = "faulty"
T = TypeVar("T")


@dataclass
class Faults:
    """What fails, and the count of what did."""

    share: float = 0.0
    """Share of requests that fail (0 while setting up, then raised)."""
    seed: int = 0
    kinds: tuple[str, ...] = ("fail", "timeout", "short")
    timeout_s: float = 0.02
    denied: set[str] = field(default_factory=set)
    """Path endings (``step_00000001/manifest.json``) whose every request is refused."""
    requests: int = 0
    failed: Counter = field(default_factory=Counter)
    """Injected failures by kind."""

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()

    @property
    def failed_total(self) -> int:
        return sum(self.failed.values())

    def request(self, action: str, path: object, op: Callable[[], T], *, read: bool = False,
                write: bool = False) -> T:
        """Run ``op`` (one ``action`` on ``path``), unless this one is to fail."""
        what = f"{action} {path}"
        with self._lock:
            self.requests += 1
            if any(str(path).endswith(end) for end in self.denied):
                self.failed["denied"] += 1
                kind = "denied"
            elif self._rng.random() < self.share:
                kinds = [k for k in self.kinds if read or k != "short"] or ["fail"]
                kind = self._rng.choice(kinds)
                self.failed[kind] += 1
            else:
                kind = None
        if kind is None:
            return op()
        if kind == "denied":
            raise PermissionError(f"injected: permission denied: {what}")
        if kind == "fail":
            raise ConnectionResetError(f"injected: connection reset during {what}")
        if kind == "timeout":
            if write:
                op()  # the store did it; the reply is lost
            time.sleep(self.timeout_s)
            raise TimeoutError(f"injected: {what} timed out after {self.timeout_s}s")
        data = op()  # a short read
        return data[:len(data) // 2]


class FaultyPath:
    """A location of the inner store whose operations go through ``Faults``."""

    def __init__(self, inner: Location, faults: Faults) -> None:
        self.inner, self.faults = inner, faults

    def _request(self, action: str, op: Callable[[], T], **kind: bool) -> T:
        return self.faults.request(action, self, op, **kind)

    def _wrap(self, inner: Location) -> "FaultyPath":
        return FaultyPath(inner, self.faults)

    def __str__(self) -> str:
        return f"{SCHEME}://{self.inner}"

    def __repr__(self) -> str:
        return f"FaultyPath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))

    def __truediv__(self, name: str) -> "FaultyPath":
        return self._wrap(self.inner / name)

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def parent(self) -> "FaultyPath":
        return self._wrap(self.inner.parent)

    def resolve(self) -> "FaultyPath":
        return self._wrap(self.inner.resolve())

    def exists(self) -> bool:
        return self._request("exists", self.inner.exists)

    def is_file(self) -> bool:
        return self._request("is_file", self.inner.is_file)

    def is_dir(self) -> bool:
        return self._request("is_dir", self.inner.is_dir)

    def iterdir(self) -> Iterator["FaultyPath"]:
        children = self._request("list", lambda: list(self.inner.iterdir()))
        return iter([self._wrap(c) for c in children])

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        self._request("mkdir", lambda: self.inner.mkdir(parents=parents, exist_ok=exist_ok),
                      write=True)

    def read_bytes(self) -> bytes:
        return self._request("read", self.inner.read_bytes, read=True)

    def read_text(self, errors: str = "strict") -> str:
        return self._request("read", lambda: self.inner.read_text(errors=errors), read=True)

    def write_bytes(self, data: bytes) -> None:
        self._request("write", lambda: self.inner.write_bytes(data), write=True)

    def write_text(self, text: str) -> None:
        self._request("write", lambda: self.inner.write_text(text), write=True)

    def unlink(self, missing_ok: bool = False) -> None:
        self._request("delete", lambda: self.inner.unlink(missing_ok=missing_ok), write=True)


class FaultyStorage(Storage):
    """``inner``'s protocol and capabilities, with ``faults`` on every request."""

    def __init__(self, inner: Storage, faults: Faults) -> None:
        self.inner, self.faults = inner, faults
        self.local_files = inner.local_files
        self.writes_in_place = inner.writes_in_place
        self.poll_s = inner.poll_s

    def url(self, where: Any) -> str:
        """The ``faulty://`` form of a path or URL of the inner store."""
        return f"{SCHEME}://{where}"

    def _call(self, action: str, path: FaultyPath, op: Callable[[], T], **kind: bool) -> T:
        return self.faults.request(action, path, op, **kind)

    def location(self, where: str) -> FaultyPath:
        inner = where.partition("://")[2]
        return FaultyPath(storage_for(inner).location(inner), self.faults)

    def kvstore(self, directory: FaultyPath) -> dict[str, Any]:
        return self.inner.kvstore(directory.inner)

    def local_path(self, directory: FaultyPath):
        return self._call("open local files of", directory,
                          lambda: self.inner.local_path(directory.inner))

    def staging_dir(self, path: FaultyPath, token: str) -> FaultyPath:
        return FaultyPath(self.inner.staging_dir(path.inner, token), self.faults)

    def commit_dir(self, tmp: FaultyPath, path: FaultyPath, manifest: str) -> None:
        self._call("commit", path, lambda: self.inner.commit_dir(tmp.inner, path.inner,
                                                                  manifest), write=True)

    def write_durably(self, path: FaultyPath, data: str | bytes) -> None:
        self._call("write", path, lambda: self.inner.write_durably(path.inner, data),
                   write=True)

    def write_marker(self, path: FaultyPath, text: str) -> None:
        self._call("write", path, lambda: self.inner.write_marker(path.inner, text),
                   write=True)

    def list_files(self, directory: FaultyPath) -> list[str]:
        return self._call("list", directory, lambda: self.inner.list_files(directory.inner))

    def stored_bytes(self, directory: FaultyPath) -> int | None:
        return self._call("list", directory, lambda: self.inner.stored_bytes(directory.inner))

    def remove(self, path: FaultyPath) -> None:
        self._call("delete", path, lambda: self.inner.remove(path.inner), write=True)

    def retire(self, path: FaultyPath) -> FaultyPath | None:
        doomed = self._call("retire", path, lambda: self.inner.retire(path.inner), write=True)
        return None if doomed is None else FaultyPath(doomed, self.faults)

    def prepare_root(self, root: FaultyPath) -> None:
        self._call("prepare", root, lambda: self.inner.prepare_root(root.inner))

    def create_exclusive(self, path: FaultyPath, data: bytes) -> bool:
        return self._call("create", path, lambda: self.inner.create_exclusive(path.inner, data),
                          write=True)

    def overwrite(self, path: FaultyPath, data: bytes) -> None:
        self._call("write", path, lambda: self.inner.overwrite(path.inner, data), write=True)

    def remove_once(self, path: FaultyPath, claimant: str) -> None:
        self._call("delete", path, lambda: self.inner.remove_once(path.inner, claimant),
                   write=True)
