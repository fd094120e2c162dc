"""A local (or mounted POSIX) file system: commit by rename.

A save writes ``.tmp_<name>.<token>/`` beside its step; the commit fsyncs every
directory, writes the manifest (temporary file, fsync, rename) and renames the
directory into place, so a crash leaves the old step or a ``.tmp_`` leftover. The
lease is created with ``O_EXCL``; a take-over renames the stale lease away first.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from elastor_mcore.checkpoint.storage.base import MANIFEST, TMP_PREFIX, Storage

IO_CONCURRENCY = 16
"""Parallel file operations per process; bounds open files and memory in flight."""


def tmp_name(name: str) -> str:
    return f"{TMP_PREFIX}{name}"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileStorage(Storage):
    local_files = True

    def location(self, where: str) -> Path:
        return Path(where)

    def kvstore(self, directory: Path) -> dict[str, Any]:
        return {"driver": "file", "path": os.fspath(directory) + "/"}

    def local_path(self, directory: Path) -> Path:
        return directory

    # ------------------------------------------------------------------ commit protocol

    def staging_dir(self, path: Path, token: str) -> Path:
        return path.parent / tmp_name(f"{path.name}.{token}" if token else path.name)

    def commit_dir(self, tmp: Path, path: Path, manifest: str) -> None:
        with ThreadPoolExecutor(IO_CONCURRENCY) as pool:  # concurrent fsyncs share journal commits
            list(pool.map(fsync_dir, (Path(d) for d, _, _ in os.walk(tmp))))
        self.write_durably(tmp / MANIFEST, manifest)
        replaced = None
        if path.exists():
            replaced = path.parent / tmp_name(path.name + ".replaced")
            os.rename(path, replaced)
        os.rename(tmp, path)
        fsync_dir(path.parent)
        if replaced is not None:
            self.remove(replaced)

    def write_durably(self, path: Path, data: str | bytes) -> None:
        """Temporary file, fsync, rename, fsync of the directory."""
        tmp = path.parent / tmp_name(path.name)
        with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)

    def write_marker(self, path: Path, text: str) -> None:
        """An empty file needs no data blocks: on a full disk the marker exists even
        where its message does not fit."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, text.encode())
        except OSError:
            pass
        finally:
            os.close(fd)
        fsync_dir(path.parent)

    # ------------------------------------------------------------------ listing, deletion

    def list_files(self, directory: Path) -> list[str]:
        if not directory.is_dir():
            return []
        return [os.fspath(f.relative_to(directory)) for f in directory.rglob("*") if f.is_file()]

    def stored_bytes(self, directory: Path) -> int:
        return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())

    def remove(self, path: Path) -> None:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)

    def retire(self, path: Path) -> Path:
        """Renamed to a ``.tmp_`` name (atomic): a crash leaves a whole step or a
        leftover, never half a step. The caller deletes the returned directory."""
        doomed = path.parent / tmp_name(path.name + ".deleting")
        os.rename(path, doomed)
        return doomed

    # ------------------------------------------------------------------ lease primitives

    def prepare_root(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)

    def create_exclusive(self, path: Path, data: bytes) -> bool:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return True

    def overwrite(self, path: Path, data: bytes) -> None:
        tmp = path.with_name(f"{path.name}.{os.getpid()}.new")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def remove_once(self, path: Path, claimant: str) -> None:
        """Rename away first: one racer's rename succeeds, the others find nothing."""
        aside = path.with_name(f"{path.name}.{claimant}")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return
        aside.unlink(missing_ok=True)
