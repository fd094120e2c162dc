"""An S3-compatible object store (``s3://BUCKET/PREFIX``; ``gs://`` maps to Google
Cloud Storage the same way, untested here), through TensorStore's kvstores: commit by
writing the manifest last.

Object stores have no rename and no ``fsync``, and a PUT of one object is atomic. A
save therefore writes straight into ``step_N/`` (first cleared, its manifest first),
and the manifest, one PUT written last, commits it; deletion removes the manifest
first. The lease is an object created by a conditional PUT (create only).

An ``ObjectPath`` offers the few ``pathlib.Path`` operations the callers use (``/``,
``name``, ``parent``, ``exists``, ``is_file``, ``is_dir``, ``iterdir``, reads, writes,
``unlink``). Endpoint, region and credentials come only from the standard AWS
environment: ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``, ``AWS_REGION`` or
``AWS_DEFAULT_REGION``, and TensorStore's credential chain (``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE`` with the shared credentials file, instance
metadata). TensorStore is imported on first use, so listing local roots stays light.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Iterator

from elastor_mcore.checkpoint.errors import StorageError
from elastor_mcore.checkpoint.storage.base import MANIFEST, Storage

SCHEMES = {"s3": "s3", "gs": "gcs"}
"""URL scheme -> TensorStore kvstore driver."""
S3_REQUEST_CONCURRENCY = 32
"""Requests in flight per process against an object store (saves and loads)."""
_NO_VALUE = b"\x02"
"""TensorStore's storage generation of a missing key: ``if_equal`` it = create only."""
_TRANSIENT = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED")
"""TensorStore status codes of a request that may succeed if repeated."""


def aws_endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


def aws_region() -> str | None:
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")


class ObjectPath:
    """A key prefix in a bucket, used like a directory path."""

    def __init__(self, url: str) -> None:
        scheme, _, rest = url.partition("://")
        bucket, _, key = rest.partition("/")
        if scheme not in SCHEMES or not bucket:
            raise StorageError(f"{url!r} is not an object-store URL: use s3://BUCKET/PREFIX "
                               f"or gs://BUCKET/PREFIX")
        self.scheme, self.bucket = scheme, bucket
        self.key = "/".join(part for part in key.split("/") if part)

    # ------------------------------------------------------------------ path algebra

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}".rstrip("/")

    def __repr__(self) -> str:
        return f"ObjectPath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectPath) and str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))

    def __truediv__(self, name: str) -> "ObjectPath":
        return ObjectPath(f"{self}/{name}")

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def parent(self) -> "ObjectPath":
        return ObjectPath(f"{self.scheme}://{self.bucket}/{self.key.rpartition('/')[0]}")

    def resolve(self) -> "ObjectPath":
        return self

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Prefixes need no creation."""

    def kvstore_spec(self, trailing_slash: bool = True) -> dict[str, Any]:
        """TensorStore kvstore spec of this prefix (``key/``), endpoint and region
        from the AWS environment."""
        path = self.key + ("/" if trailing_slash and self.key else "")
        spec: dict[str, Any] = {"driver": SCHEMES[self.scheme], "bucket": self.bucket,
                                "path": path}
        if self.scheme == "s3":
            if aws_endpoint():
                spec["endpoint"] = aws_endpoint()
            if aws_region():
                spec["aws_region"] = aws_region()
        return spec

    # ------------------------------------------------------------------ queries

    def keys(self) -> list[str]:
        """Every object key below this prefix, relative to it."""
        prefix = self.key + "/" if self.key else ""
        found = self._call("list", lambda kv: kv.list(_prefix_range(prefix)).result())
        return [k.decode()[len(prefix):] for k in found]

    def check_access(self) -> None:
        """Raise ``CheckpointError`` now if the bucket is missing or the credentials are
        refused (one LIST), rather than at the first save."""
        self.keys()

    def is_file(self) -> bool:
        """One LIST of this key as a prefix (no GET of the object)."""
        found = self._call("list", lambda kv: kv.list(_prefix_range(self.key)).result())
        return self.key.encode() in found

    def is_dir(self) -> bool:
        return bool(self.keys())

    def exists(self) -> bool:
        return self.is_dir() or self.is_file()

    def iterdir(self) -> Iterator["ObjectPath"]:
        for child in sorted({k.split("/", 1)[0] for k in self.keys()}):
            yield self / child

    def read_bytes(self) -> bytes:
        value = self._read()
        if value is None:
            raise FileNotFoundError(f"{self} does not exist")
        return value

    def read_text(self, errors: str = "strict") -> str:
        return self.read_bytes().decode(errors=errors)

    # ------------------------------------------------------------------ changes

    def write_bytes(self, data: bytes) -> None:
        """One PUT: readers see the old object or the new one, never a part."""
        self._call("write", lambda kv: kv.write(self.key, data).result())

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode())

    def create(self, data: bytes) -> bool:
        """Write only if the object does not exist (a conditional PUT); False if it
        did. Of two racing creators exactly one succeeds, where the store supports
        conditional writes."""
        stamp = self._call("create", lambda kv: kv.write(self.key, data,
                                                         if_equal=_NO_VALUE).result())
        return bool(stamp.generation)  # empty: the condition failed

    def unlink(self, missing_ok: bool = True) -> None:
        self._call("delete", lambda kv: kv.write(self.key, None).result())

    def remove_tree(self) -> None:
        """Delete every object below this prefix."""
        prefix = self.key + "/"
        self._call("delete", lambda kv: kv.delete_range(_prefix_range(prefix)).result())

    # ------------------------------------------------------------------ plumbing

    def _read(self) -> bytes | None:
        result = self._call("read", lambda kv: kv.read(self.key).result())
        return result.value if result.state == "value" else None

    def _call(self, action: str, op):
        try:
            return op(_bucket_store(self.scheme, self.bucket, aws_endpoint(), aws_region()))
        except ValueError as exc:  # TensorStore reports storage errors as ValueError
            raise _storage_error(exc, f"{action} {self}") from exc


def explain(exc: BaseException, what: str) -> str:
    """A storage error as a sentence naming the problem and the fix."""
    text = str(exc).split(" [", 1)[0]
    if "NoSuchBucket" in text:
        fix = ("the bucket does not exist: create it, or fix the URL (endpoint "
               f"{aws_endpoint() or 'the default AWS endpoint'})")
    elif any(m in text for m in ("InvalidAccessKeyId", "SignatureDoesNotMatch",
                                 "AccessDenied", "PERMISSION_DENIED", "UNAUTHENTICATED")):
        fix = ("the credentials were refused: check AWS_ACCESS_KEY_ID / "
               "AWS_SECRET_ACCESS_KEY or AWS_PROFILE and the bucket's policy")
    elif "UNAVAILABLE" in text or "Failed to connect" in text:
        fix = (f"the object store at {aws_endpoint() or 'the default AWS endpoint'} cannot "
               f"be reached: check AWS_ENDPOINT_URL and the network")
    else:
        fix = "see the storage error"
    return f"{what} failed: {fix} ({text})"


def _storage_error(exc: ValueError, what: str) -> StorageError:
    return StorageError(explain(exc, what), transient=any(c in str(exc) for c in _TRANSIENT))


def _prefix_range(prefix: str):
    import tensorstore as ts

    if not prefix:
        return ts.KvStore.KeyRange()
    return ts.KvStore.KeyRange(prefix.encode(), prefix[:-1].encode() + bytes([ord(prefix[-1]) + 1]))


@functools.lru_cache(maxsize=None)
def _bucket_store(scheme: str, bucket: str, endpoint: str | None, region: str | None):
    """One kvstore per bucket (and environment): small-object operations."""
    import tensorstore as ts

    root = ObjectPath(f"{scheme}://{bucket}")
    try:
        return ts.KvStore.open(root.kvstore_spec(trailing_slash=False),
                               context=object_context()).result()
    except ValueError as exc:
        raise _storage_error(exc, f"open {root}") from exc


@functools.lru_cache(maxsize=1)
def object_context():
    """Bounded concurrent requests and no cache (every byte is read once)."""
    import tensorstore as ts

    return ts.Context({"s3_request_concurrency": {"limit": S3_REQUEST_CONCURRENCY},
                       "cache_pool": {"total_bytes_limit": 0}})


class ObjectStorage(Storage):
    writes_in_place = True
    poll_s = 0.1
    """Marker polls cost requests: ten a second."""

    def location(self, where: str) -> ObjectPath:
        return ObjectPath(where)

    def kvstore(self, directory: ObjectPath) -> dict[str, Any]:
        return directory.kvstore_spec()

    # ------------------------------------------------------------------ commit protocol

    def staging_dir(self, path: ObjectPath, token: str) -> ObjectPath:
        """No rename: the step is written in place, and its manifest commits it."""
        return path

    def commit_dir(self, tmp: ObjectPath, path: ObjectPath, manifest: str) -> None:
        (path / MANIFEST).write_text(manifest)

    def write_durably(self, path: ObjectPath, data: str | bytes) -> None:
        """One PUT: readers see the old object or the new one, never a part."""
        path.write_bytes(data if isinstance(data, bytes) else data.encode())

    def write_marker(self, path: ObjectPath, text: str) -> None:
        path.write_text(text)

    # ------------------------------------------------------------------ listing, deletion

    def list_files(self, directory: ObjectPath) -> list[str]:
        return directory.keys()

    def stored_bytes(self, directory: ObjectPath) -> None:
        """A listing gives no sizes."""
        return None

    def remove(self, path: ObjectPath) -> None:
        (path / MANIFEST).unlink()
        path.remove_tree()
        path.unlink()

    def retire(self, path: ObjectPath) -> None:
        """Deleted at once, its manifest first."""
        self.remove(path)
        return None

    # ------------------------------------------------------------------ lease primitives

    def prepare_root(self, root: ObjectPath) -> None:
        root.check_access()  # else a failing create reads as a taken lease

    def create_exclusive(self, path: ObjectPath, data: bytes) -> bool:
        return path.create(data)

    def overwrite(self, path: ObjectPath, data: bytes) -> None:
        path.write_bytes(data)

    def remove_once(self, path: ObjectPath, claimant: str) -> None:
        path.unlink()
