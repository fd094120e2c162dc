"""TensorStore plumbing shared by the writer and the reader: one bounded context,
zero-copy views of torch tensors, batched futures, and the storage byte counters.
"""

from __future__ import annotations

import functools
from typing import Iterable

import numpy as np
import tensorstore as ts
import torch

from elastor_mcore.checkpoint import fast_read
from elastor_mcore.checkpoint.format import CheckpointError, TensorEntry, array_spec, failed_for
from elastor_mcore.checkpoint.storage import Location
from elastor_mcore.checkpoint.storage.file import IO_CONCURRENCY
from elastor_mcore.checkpoint.storage.object_store import S3_REQUEST_CONCURRENCY


@functools.lru_cache(maxsize=1)
def shared_context() -> ts.Context:
    """One context per process: bounded I/O (files and object-store requests), fsync
    on every write, no chunk cache (every byte is read once, so caching would only cost
    memory)."""
    return ts.Context({
        "file_io_concurrency": {"limit": IO_CONCURRENCY},
        "s3_request_concurrency": {"limit": S3_REQUEST_CONCURRENCY},
        "data_copy_concurrency": {"limit": IO_CONCURRENCY},
        "file_io_sync": True,
        "cache_pool": {"total_bytes_limit": 0},
    })


def numpy_view(tensor: torch.Tensor) -> np.ndarray:
    """A numpy array sharing ``tensor``'s memory and strides (bf16 via TensorStore's
    numpy bfloat16), so reads land in place and writes copy nothing."""
    if tensor.device.type != "cpu":
        raise CheckpointError(f"checkpoint I/O needs CPU tensors, got {tensor.device}; "
                              f"copy device tensors to host first")
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ts.bfloat16.numpy_dtype)
    return tensor.numpy()


def open_arrays(step_dir: Location, entries: dict[str, TensorEntry], *,
                create: bool, fill_missing: bool = True) -> dict[str, ts.TensorStore]:
    """Open (or, with ``create``, create the metadata of) many arrays concurrently.

    Without ``create`` the manifest's entries are trusted (``assume_metadata``): no
    ``zarr.json`` reads, so a load touches only chunk data and file indices. Without
    ``fill_missing`` a read of a missing chunk fails (``format.array_spec``).
    """
    ctx = shared_context()
    futures = {
        key: ts.open(array_spec(step_dir, key, entry, fill_missing=fill_missing), context=ctx,
                     **({"create": True} if create else
                        {"open": True, "assume_metadata": True}))
        for key, entry in entries.items()
    }
    return dict(zip(futures, wait_all(futures.items(), "open")))


def wait_all(futures: Iterable[tuple[str, ts.Future]], action: str) -> list:
    """Wait for already-issued futures; raise one error naming every failed tensor."""
    results, failures = [], []
    for key, future in futures:
        try:
            results.append(future.result())
        except Exception as exc:  # TensorStore raises ValueError/OSError subtypes
            failures.append(f"tensor {key}: {exc}")
    if failures:
        lowered = [f.lower() for f in failures]
        corrupt = any(m in f for f in lowered for m in ("digest mismatch", "data_loss"))
        missing = any("not_found" in f and "is missing" in f for f in lowered)
        hint = (" (checksum mismatch: the file is corrupted; load another step)" if corrupt
                else " (a chunk of a committed step is missing: the checkpoint is damaged; "
                     "load another step)" if missing else "")
        raise CheckpointError(f"{action} failed for " + failed_for(failures) + hint)
    return results


def storage_bytes_read() -> int:
    """Bytes this process has read from checkpoint storage so far: through TensorStore's
    ``file``, ``s3`` and ``gcs`` kvstores and through ``fast_read``."""
    return sum(_metric(f"/tensorstore/kvstore/{driver}/bytes_read")
               for driver in ("file", "s3", "gcs")) + fast_read.bytes_read()


def _metric(name: str) -> int:
    metrics = ts.experimental_collect_matching_metrics(name)
    return sum(int(v.get("value", 0)) for m in metrics if m["name"] == name
               for v in m["values"])
