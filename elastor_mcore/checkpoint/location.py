"""Where a checkpoint lives: a local directory or an object-store URL.

``s3://bucket/prefix`` (Amazon S3 and S3-compatible stores) and ``gs://bucket/prefix``
(Google Cloud Storage, untested here) name the same layout as a local root. An
``ObjectPath`` offers the few ``pathlib.Path`` operations the checkpoint code uses
(``/``, ``name``, ``parent``, ``exists``, ``is_file``, ``is_dir``, ``iterdir``, reads,
writes, ``unlink``), so the format helpers work on either; what object storage cannot
do (rename, ``fsync``) the writer does differently (see docs/checkpoint-format.md).

Endpoint, region and credentials come only from the standard AWS environment:
``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``, ``AWS_REGION`` or
``AWS_DEFAULT_REGION``, and TensorStore's credential chain (``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE`` with the shared credentials file, instance
metadata). TensorStore is imported on first use, so the format helpers stay light for
local roots.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
from pathlib import Path
from typing import IO, Any, Iterator

from elastor_mcore.checkpoint.errors import CheckpointError

SCHEMES = {"s3": "s3", "gs": "gcs"}
"""URL scheme -> TensorStore kvstore driver."""
S3_REQUEST_CONCURRENCY = 32
"""Requests in flight per process against an object store (saves and loads)."""
_NO_VALUE = b"\x02"
"""TensorStore's storage generation of a missing key: ``if_equal`` it = create only."""


def is_url(path: str | os.PathLike | "ObjectPath") -> bool:
    return isinstance(path, ObjectPath) or (
        isinstance(path, str) and path.split("://", 1)[0] in SCHEMES and "://" in path)


def as_path(path: str | os.PathLike | "ObjectPath") -> "Path | ObjectPath":
    """``path`` as a ``Path``, or an ``ObjectPath`` for an object-store URL."""
    if isinstance(path, (Path, ObjectPath)):
        return path
    return ObjectPath(path) if is_url(path) else Path(path)


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
            raise CheckpointError(f"{url!r} is not an object-store URL: use "
                                  f"s3://BUCKET/PREFIX or gs://BUCKET/PREFIX")
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
            raise CheckpointError(explain(exc, f"{action} {self}")) from exc


@contextlib.contextmanager
def open_object(url: str | ObjectPath, mode: str = "r") -> Iterator[IO]:
    """``open`` for a small object (a tracker file): reading is one GET, writing one PUT
    when the block ends (readers see the old object or the new one)."""
    path = as_path(url)
    if mode not in ("r", "rb", "w", "wb"):
        raise ValueError(f"open_object({str(path)!r}, {mode!r}): only r, rb, w and wb")
    binary = "b" in mode
    if mode.startswith("r"):
        data = path.read_bytes()
        yield io.BytesIO(data) if binary else io.StringIO(data.decode())
        return
    buffer = io.BytesIO() if binary else io.StringIO()
    yield buffer
    value = buffer.getvalue()
    path.write_bytes(value if binary else value.encode())


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
        raise CheckpointError(explain(exc, f"open {root}")) from exc


@functools.lru_cache(maxsize=1)
def object_context():
    """Bounded concurrent requests and no cache (every byte is read once)."""
    import tensorstore as ts

    return ts.Context({"s3_request_concurrency": {"limit": S3_REQUEST_CONCURRENCY},
                       "cache_pool": {"total_bytes_limit": 0}})
