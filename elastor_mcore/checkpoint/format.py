"""The on-disk checkpoint format: manifest dataclasses, directory names, chunk choice
and the zarr v3 array spec of each tensor.

Everything a reader needs to interpret a step directory lives here, so the writer and
the reader cannot disagree about it. See ``docs/checkpoint-format.md``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from elastor_mcore.checkpoint.errors import CheckpointError, StorageError
from elastor_mcore.checkpoint.storage import (
    MANIFEST, TMP_PREFIX, Location, as_path, retrying, storage_for)

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
"""Version 2 stores every inner chunk inside an array, chunks of zeros too, so a
missing file or chunk is damage and the reader says so. Version 1 (TensorStore left
chunks equal to the fill value unwritten) reads a missing one as zeros."""
EVERY_CHUNK_STORED = 2
LATEST = "latest"
_STEP_RE = re.compile(r"^step_(\d+)$")
_RESERVED_KEYS = {MANIFEST, "zarr.json", LATEST}

DTYPE_ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}
"""Tensor dtypes the format stores (torch names, which are also zarr v3 names)."""


def failed_for(failures: list[str]) -> str:
    """``failures`` as one message: the first five, and how many more."""
    return "; ".join(failures[:5]) + (f"; and {len(failures) - 5} more" if len(failures) > 5
                                      else "")


def file_path(step_dir: Path, key: str, file_coords: Sequence[int]) -> Path:
    """The file of the outer chunk at ``file_coords`` of array ``key`` (zarr v3's default
    chunk key encoding, ``c/<i>/<j>/...``)."""
    return step_dir.joinpath(key, "c", *(str(i) for i in file_coords))


# --------------------------------------------------------------------------- manifest


@dataclass(frozen=True)
class TensorEntry:
    """Index entry of one global tensor: how it is cut into inner chunks and files."""

    shape: tuple[int, ...]
    dtype: str
    chunks: tuple[int, ...]
    """Inner chunk shape: the unit of a range read and of a checksum."""
    shard: tuple[int, ...]
    """Outer chunk shape: the inner chunks of one outer chunk share one file."""
    checksum: str = "crc32c"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]

    @property
    def num_chunks(self) -> int:
        return math.prod(-(-n // c) for n, c in zip(self.shape, self.chunks))

    @property
    def num_files(self) -> int:
        return math.prod(-(-n // s) for n, s in zip(self.shape, self.shard))

    @staticmethod
    def from_json(data: dict[str, Any]) -> "TensorEntry":
        return TensorEntry(shape=tuple(data["shape"]), dtype=data["dtype"],
                           chunks=tuple(data["chunks"]), shard=tuple(data["shard"]),
                           checksum=data.get("checksum", "crc32c"))


_MANIFEST_FIELDS = ("model", "layout", "consumed_samples", "rng", "optimizer", "objects")


@dataclass
class Manifest:
    """The commit record of one step, written last. Plain JSON, never pickle.

    ``model`` is the recipe's model config, ``layout`` the layout at save time,
    ``optimizer`` its hyper-parameters and step count, ``objects`` the JSON values of
    mcore ShardedObjects; anything else the caller passes lands in ``extra``.
    """

    step: int
    tensors: dict[str, TensorEntry]
    model: dict[str, Any] | None = None
    layout: Any = None
    consumed_samples: int | None = None
    rng: Any = None
    optimizer: dict[str, Any] | None = None
    objects: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    writers: int = 1
    format_version: int = FORMAT_VERSION

    @property
    def every_chunk_stored(self) -> bool:
        """Whether a chunk missing from this step is damage rather than zeros."""
        return self.format_version >= EVERY_CHUNK_STORED

    @staticmethod
    def build(step: int, tensors: dict[str, TensorEntry], writers: int,
              manifest_extra: dict[str, Any] | None) -> "Manifest":
        """Sort the caller's ``manifest_extra`` into the named fields and ``extra``."""
        extra = dict(manifest_extra or {})
        named = {k: extra.pop(k) for k in _MANIFEST_FIELDS if k in extra}
        return Manifest(step=step, tensors=tensors, writers=writers, extra=extra, **named)

    def to_json(self) -> str:
        data = asdict(self)
        data["tensors"] = {k: asdict(v) for k, v in sorted(self.tensors.items())}
        try:
            return json.dumps(data, indent=1, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as exc:
            bad = [k for k in (*_MANIFEST_FIELDS, "extra") if not _is_json(data.get(k))]
            raise CheckpointError(
                f"manifest field(s) {bad or ['?']} of step {self.step} are not plain JSON "
                f"({exc}); pass lists, dicts, strings and numbers (encode bytes as "
                f"base64)") from exc

    @staticmethod
    def from_json(text: str, where: str) -> "Manifest":
        """Parse a manifest. Text that is not whole JSON raises a transient
        ``StorageError``: a short read looks the same, and reading again may succeed."""
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise StorageError(f"{where} is not complete JSON ({len(text)} characters: a "
                               f"short read, or a corrupted file): {exc}",
                               transient=True) from exc
        try:
            version = data["format_version"]
            if version > FORMAT_VERSION:
                raise CheckpointError(
                    f"{where} has checkpoint format version {version}; this elastor-mcore "
                    f"reads versions <= {FORMAT_VERSION}: upgrade elastor-mcore")
            data["tensors"] = {k: TensorEntry.from_json(v) for k, v in data["tensors"].items()}
            return Manifest(**data)
        except CheckpointError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{where} is not a valid checkpoint manifest: {exc!r}") from exc


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
        return True
    except (TypeError, ValueError):
        return False


def read_manifest(step_dir: str | os.PathLike | Location) -> Manifest:
    """The manifest of a committed step (read again after a transient error)."""
    path = as_path(step_dir) / MANIFEST

    def read() -> Manifest:
        try:
            text = path.read_text()
        except FileNotFoundError as exc:
            raise CheckpointError(
                f"{step_dir} has no {MANIFEST}: the save never committed; load another "
                f"step or the root directory") from exc
        return Manifest.from_json(text, str(path))

    return retrying(read, f"reading {path}")


def check_compatible(manifest: Manifest, model_config: dict[str, Any]) -> None:
    """Raise ``CheckpointError`` naming every model field where the checkpoint and
    ``model_config`` (the run's recipe model section) differ."""
    if manifest.model is None:
        raise CheckpointError(
            f"checkpoint of step {manifest.step} records no model config (field 'model'); "
            f"it cannot be checked against this run")
    saved, run = manifest.model, dict(model_config)
    diffs = [f"model.{k}: checkpoint has {saved.get(k, '<missing>')!r}, "
             f"run has {run.get(k, '<missing>')!r}"
             for k in sorted(set(saved) | set(run)) if saved.get(k) != run.get(k)]
    if diffs:
        raise CheckpointError(
            f"checkpoint of step {manifest.step} was saved for a different model: "
            + "; ".join(diffs) + ". Use the recipe the checkpoint was saved with, or "
            "start from scratch")


# --------------------------------------------------------------------------- paths


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def parse_step(name: str) -> int | None:
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


def committed_steps(root: str | os.PathLike) -> list[int]:
    """Steps under ``root`` whose manifest is in place, ascending."""
    root = as_path(root)
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        step = parse_step(entry.name)
        if step is not None and (entry / MANIFEST).is_file():
            steps.append(step)
    return sorted(steps)


def latest_step(root: str | os.PathLike) -> int | None:
    """The step ``latest`` names if it is committed, else the newest committed step."""
    root = as_path(root)
    steps = committed_steps(root)
    try:
        text = (root / LATEST).read_text()
    except FileNotFoundError:
        text = ""
    # Written with a final newline: a text without one was cut short (a short read
    # of "step_00000010\n" must not name step 1).
    named = parse_step(text.strip()) if text.endswith("\n") else None
    if named is not None and named in steps:
        return named
    if steps:
        log.warning("%s/%s does not name a committed step; using step %d",
                    root, LATEST, steps[-1])
        return steps[-1]
    return None


def resolve_step_dir(path_or_root: str | os.PathLike | Location) -> Location:
    """A committed step directory: ``path_or_root`` itself, or the latest under it
    (looked up again after a transient storage error)."""
    path = as_path(path_or_root)
    return retrying(lambda: _resolve(path), f"finding the step to load in {path}")


def _resolve(path: Location) -> Location:
    if (path / MANIFEST).is_file():
        return path
    if not path.is_dir():
        raise CheckpointError(f"checkpoint path {path} does not exist")
    if parse_step(path.name) is not None or path.name.startswith(TMP_PREFIX):
        raise CheckpointError(
            f"{path} has no {MANIFEST}: the save never committed; load another step or "
            f"the root directory {path.parent}")
    step = latest_step(path)
    if step is None:
        raise CheckpointError(
            f"no committed checkpoint in {path} (no step_N/{MANIFEST}); check the path or "
            f"start from scratch")
    return path / step_dir_name(step)


def validate_key(key: str) -> None:
    if not key or "/" in key or key.startswith(".") or key in _RESERVED_KEYS:
        raise CheckpointError(
            f"tensor key {key!r} cannot name a directory: keys must be non-empty, contain "
            f"no '/', not start with '.', and not be one of {sorted(_RESERVED_KEYS)}")


# --------------------------------------------------------------------------- chunking


@dataclass(frozen=True)
class ChunkPolicy:
    """How tensors are cut into inner chunks and files.

    ``split_sizes`` are the TP degrees any future layout may use: inner chunks along a
    split dimension divide ``dim / lcm(split_sizes)`` so every such shard is a union of
    chunks. Dimensions no saving rank splits are kept whole when the chunk stays under
    ``chunk_bytes``. Files (outer chunks) never straddle a saving rank's shard boundary
    and hold at most ``file_bytes``, so every file has one writer and replicated tensors
    split into enough files to spread the writing.
    """

    split_sizes: tuple[int, ...] = (1, 2, 4, 8)
    chunk_bytes: int = 256 * 1024
    file_bytes: int = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        if not self.split_sizes or any(int(t) < 1 for t in self.split_sizes):
            raise CheckpointError(f"ChunkPolicy.split_sizes must be positive, got "
                                  f"{self.split_sizes}")
        if self.chunk_bytes < 1 or self.file_bytes < self.chunk_bytes:
            raise CheckpointError(
                f"ChunkPolicy needs 1 <= chunk_bytes <= file_bytes, got "
                f"chunk_bytes={self.chunk_bytes}, file_bytes={self.file_bytes}")


def _shrink(shape: list[int], unit: Sequence[int], itemsize: int, limit: int) -> list[int]:
    """The largest sub-shape under ``limit`` bytes that cuts leading dims first: each
    result divides the input and stays a multiple of ``unit``. Leading dims first keeps
    the trailing ones whole as long as the limit allows: a chunk of whole rows is
    contiguous in a target that holds whole rows (a column-parallel or vocabulary
    shard, any TP1 shard), so it is read straight into it, with no bounce buffer."""
    for dim in range(len(shape)):
        if math.prod(shape) * itemsize <= limit:
            break
        others = math.prod(shape) // shape[dim] * itemsize
        ratio = shape[dim] // unit[dim]
        factor = next((f for f in range(2, ratio + 1)
                       if ratio % f == 0 and shape[dim] // f * others <= limit), ratio)
        shape[dim] //= factor
    return shape


def choose_entry(shape: Sequence[int], dtype: str, cuts: Sequence[Sequence[int]],
                 policy: ChunkPolicy) -> TensorEntry:
    """Chunk and file shape of a tensor, given the cut points of the saving ranks'
    shards along each dim (``cuts[d]`` includes 0 and ``shape[d]``)."""
    itemsize = DTYPE_ITEMSIZE[dtype]
    split = [d for d in range(len(shape)) if len(set(cuts[d]) - {0, shape[d]}) > 0]
    unknown = not split  # saved unsplit: any dim may be split later
    chunks = []
    for d, n in enumerate(shape):
        if unknown or d in split:
            parts = math.lcm(*(t for t in policy.split_sizes if n % t == 0))
            chunks.append(max(1, n // parts))
        else:
            chunks.append(max(1, n))
    shard = [math.gcd(*cuts[d]) or max(1, n) for d, n in enumerate(shape)]
    chunks = [math.gcd(c, s) for c, s in zip(chunks, shard)]
    chunks = _shrink(chunks, [1] * len(shape), itemsize, policy.chunk_bytes)
    shard = _shrink(shard, chunks, itemsize, policy.file_bytes)
    return TensorEntry(tuple(shape), dtype, tuple(chunks), tuple(shard))


def array_spec(step_dir: str | os.PathLike, key: str, entry: TensorEntry, *,
               fill_missing: bool = True) -> dict[str, Any]:
    """TensorStore ``zarr3`` spec of one tensor: files of inner chunks
    (``sharding_indexed``), crc32c on every chunk and on each file's index. Writes
    store chunks of zeros too (format version 2); reads without ``fill_missing``
    fail on a missing chunk instead of returning zeros."""
    checksum = [{"name": "crc32c"}] if entry.checksum == "crc32c" else []
    little = {"name": "bytes", "configuration": {"endian": "little"}}
    where = as_path(step_dir) / key
    return {
        "driver": "zarr3",
        "kvstore": storage_for(where).kvstore(where),
        "store_data_equal_to_fill_value": True,
        "fill_missing_data_reads": fill_missing,
        "metadata": {
            "shape": list(entry.shape),
            "data_type": entry.dtype,
            "chunk_grid": {"name": "regular",
                           "configuration": {"chunk_shape": list(entry.shard)}},
            "chunk_key_encoding": {"name": "default"},
            "fill_value": False if entry.dtype == "bool" else 0,
            "codecs": [{"name": "sharding_indexed", "configuration": {
                "chunk_shape": list(entry.chunks),
                "codecs": [little, *checksum],
                "index_codecs": [little, *checksum],
                "index_location": "end",
            }}],
        },
    }
