"""Megatron-LM checkpoints in the elastor zarr format, behind the signatures of
``megatron.core.dist_checkpointing.save/load``.

Megatron-LM hands ``dist_checkpointing.save`` one state dict holding ShardedTensors
(model, optimizer), ShardedObjects (RNG, extra state) and plain values (args,
iteration, scheduler). Here each goes where it fits:

* ShardedTensors: the elastor zarr checkpoint (``checkpoint.write_checkpoint``),
  every global tensor once, loadable by any layout;
* plain values: ``common.pt`` written by rank 0, and ShardedObjects: one
  ``megatron_objects/<unique_key>.pt`` per object written by one of its main
  replicas, both ``torch.save`` files as mcore's own torch_dist format stores them
  (Megatron's args hold dtypes and callables, which JSON cannot), committed with the
  tensors (the writer's named files: one plan step and one finish for all of it);
* ``metadata.json`` last, with ``sharded_backend: elastor_zarr``: Megatron-LM's format
  detection sees a distributed checkpoint, and the patched ``load`` tells it from
  torch_dist by this marker. A directory without it never loads.

``async_save`` (Megatron-LM's ``--async-save``) snapshots the state and writes it in a
background thread while training goes on.

A checkpoint directory may also be an ``s3://`` URL (``checkpoint.storage``): the
files are objects, written in place, and ``metadata.json``, the last PUT, still marks
the checkpoint complete.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from elastor_mcore.checkpoint import comm
from elastor_mcore.checkpoint.adapter import load_sharded_state_dict, local_shards
from elastor_mcore.checkpoint.format import ChunkPolicy
from elastor_mcore.checkpoint.plan import NO_REPLICAS, Replicas
from elastor_mcore.checkpoint.storage import Location, as_path, retrying, storage_for
from elastor_mcore.checkpoint.writer import prune_oldest, write_checkpoint, write_file

log = logging.getLogger(__name__)

BACKEND = "elastor_zarr"
BACKEND_VERSION = 1
CONFIG_FILE = "metadata.json"
"""mcore's ``CONFIG_FNAME``: the file its format detection looks for."""
COMMON_FILE = "common.pt"
OBJECTS_DIR = "megatron_objects"
CONTENT_METADATA_KEY = "content_metadata"
TRACKER_FILE = "latest_checkpointed_iteration.txt"
"""Megatron-LM's tracker: the newest iteration whose save completed."""
_ITER_RE = re.compile(r"^iter_(\d+)$")
_BACKGROUND_GROUP = None


@dataclass(frozen=True)
class ZarrSaveSettings:
    """How Megatron-LM's saves are written."""

    chunking: ChunkPolicy | None = None
    """Inner chunking; pass the TP degrees future layouts may use as ``split_sizes``."""
    keep: int = 0
    """Keep this many newest zarr ``iter_*`` checkpoints beside each save; 0 keeps all."""
    manifest_extra: dict[str, Any] = field(default_factory=dict)
    """Recorded in every manifest (e.g. ``layout`` and ``model``)."""


def backend_of(checkpoint_dir: str | os.PathLike) -> str | None:
    """The ``sharded_backend`` named by ``metadata.json``, or None without one."""
    try:
        return json.loads((as_path(checkpoint_dir) / CONFIG_FILE).read_text()).get(
            "sharded_backend")
    except (FileNotFoundError, NotADirectoryError, ValueError, AttributeError):
        return None


def is_zarr_checkpoint(checkpoint_dir: str | os.PathLike) -> bool:
    return backend_of(checkpoint_dir) == BACKEND


@dataclass
class _Prepared:
    """A state dict split for writing; plain values and objects already serialised."""

    tensors: dict
    step: int
    common: bytes
    objects: dict[str, bytes]
    """``unique_key`` -> serialised data, for the ShardedObjects this rank writes."""


def _on_host(state: dict, *, copy: bool, always: bool = False) -> None:
    """Give every ShardedTensor (and factory) of ``state`` host memory: a copy of its
    data (``copy``) or an empty buffer, for device tensors only unless ``always``.
    The elastor reader and writer work on host memory."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    def stage(value):
        if isinstance(value, (ShardedTensor, ShardedTensorFactory)) and \
                value.data is not None and (always or value.data.device.type != "cpu"):
            value.data = value.data.detach().to("cpu", copy=True) if copy else \
                torch.empty_like(value.data, device="cpu")
        return value

    dict_list_map_inplace(stage, state)


def _prepare(sharded_state_dict: dict, content_metadata: dict | None, *,
             snapshot: bool) -> _Prepared:
    """Split the state; ``snapshot`` copies every tensor so training may go on."""
    from megatron.core.dist_checkpointing.dict_utils import (
        extract_matching_values, nested_values)
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject, apply_factories, is_main_replica)
    from megatron.core.dist_checkpointing.utils import (
        extract_nonpersistent, extract_sharded_base)

    if content_metadata is not None:
        sharded_state_dict[CONTENT_METADATA_KEY] = content_metadata
    _, persistent = extract_nonpersistent(sharded_state_dict)
    sharded, common = extract_sharded_base(persistent)
    objects, tensors = extract_matching_values(sharded, lambda v: isinstance(v, ShardedObject))
    apply_factories(tensors)
    _on_host(tensors, copy=True, always=snapshot)
    step = common.get("iteration", 0)
    return _Prepared(
        tensors=tensors, step=step if isinstance(step, int) and step >= 0 else 0,
        common=_serialise(common),
        objects={obj.unique_key: _serialise(obj.data) for obj in nested_values(objects)
                 if is_main_replica(obj.replica_id)})


def _write(prepared: _Prepared, path: Location, settings: ZarrSaveSettings,
           replicas: Replicas, group=None) -> None:
    """One save in the writer's two job-wide steps: the tensors, ``common.pt`` (the
    coordinator's) and the ShardedObjects' files (one writer each among their main
    replicas, chosen in the plan step) are committed together, then ``metadata.json``
    is written and old iterations pruned."""
    files = {f"{OBJECTS_DIR}/{key}.pt": data for key, data in prepared.objects.items()}
    if comm.is_coordinator(group):
        files[COMMON_FILE] = prepared.common

    def finish() -> None:
        write_config(path)
        if settings.keep:
            prune(path.parent, settings.keep, path)

    result = write_checkpoint(path, prepared.step, local_shards(prepared.tensors),
                              settings.manifest_extra, group, settings.chunking,
                              on_commit=finish, replicas=replicas, files=files)
    log.info("saved Megatron-LM checkpoint %s in the elastor zarr format: %d job-wide "
             "calls, %d replica classes, %d tensors on a grid", path, result.calls,
             len(replicas.classes), len(replicas.grid or {}))


def save(sharded_state_dict: dict, checkpoint_dir: str | os.PathLike,
         settings: ZarrSaveSettings, *, content_metadata: dict | None = None,
         replicas: Replicas = NO_REPLICAS) -> None:
    """Save a Megatron-LM state dict into ``checkpoint_dir`` (collective, every rank).
    ``replicas``: which ranks hold the same tensors (``checkpoint.Replicas``, from the
    layout), so that the plan follows the distinct shards, not their copies.

    The directory is replaced atomically; ``metadata.json`` is written last.
    """
    _write(_prepare(sharded_state_dict, content_metadata, snapshot=False),
           as_path(checkpoint_dir), settings, replicas)


def async_save(sharded_state_dict: dict, checkpoint_dir: str | os.PathLike,
               settings: ZarrSaveSettings, *, content_metadata: dict | None = None,
               replicas: Replicas = NO_REPLICAS):
    """Start a save that overlaps training; returns mcore's ``AsyncRequest``.

    Tensors are copied to host memory and everything else serialised before this
    returns, so training may change the model at once. A background thread writes
    over a process group of its own (collectives there never interleave with the
    training's). The request's ``async_fn``, which Megatron-LM runs in a helper
    process, waits until the thread is done, so Megatron-LM's queue sees the save in
    flight until then; its finalize step joins the thread and raises its error.
    """
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    prepared = _prepare(sharded_state_dict, content_metadata, snapshot=True)
    group = _background_group()
    signal_dir = Path(tempfile.mkdtemp(prefix="elastor_async_save_"))
    errors: list[BaseException] = []

    def run() -> None:
        try:
            _write(prepared, as_path(checkpoint_dir), settings, replicas, group)
        except BaseException as exc:  # re-raised by finalize on the caller's thread
            errors.append(exc)
        finally:
            (signal_dir / "done").touch()

    thread = threading.Thread(target=run, name="elastor-async-save", daemon=True)
    thread.start()

    def finalize() -> None:
        thread.join()
        shutil.rmtree(signal_dir, ignore_errors=True)
        if errors:
            raise errors[0]

    return AsyncRequest(wait_for_file, (os.fspath(signal_dir / "done"),), [finalize])


def wait_for_file(path: str, poll_s: float = 0.05) -> None:
    """The ``async_fn`` of an async save: returns once ``path`` exists (it runs in a
    helper process, so a file is how the writing thread signals it)."""
    while not os.path.exists(path):
        time.sleep(poll_s)


def _background_group():
    """A gloo group of the whole world for background saves, created on first use
    (every rank reaches its first async save at the same point)."""
    global _BACKGROUND_GROUP
    import torch.distributed as dist

    if _BACKGROUND_GROUP is None and dist.is_available() and dist.is_initialized():
        _BACKGROUND_GROUP = dist.new_group(backend="gloo")
    return _BACKGROUND_GROUP


def load(sharded_state_dict: dict, checkpoint_dir: str | os.PathLike, *,
         replicas: Replicas = NO_REPLICAS) -> dict:
    """Load ``sharded_state_dict`` (any layout) and return the full state dict: common
    values, ShardedObjects and tensors, factories merged. Host tensors are filled in
    place; device tensors come back in host buffers, which Megatron-LM copies into
    the model with ``load_state_dict`` as it does after mcore's own load."""
    from megatron.core.dist_checkpointing.dict_utils import (
        dict_list_map_inplace, extract_matching_values, merge)
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megatron.core.dist_checkpointing.utils import (
        extract_nonpersistent, extract_sharded_base)

    path = as_path(checkpoint_dir)
    common = load_common_state_dict(path)
    # As mcore's own load: plain values of the request come from common.pt (dropped
    # here), LocalNonpersistentObjects keep the caller's values (unwrapped into it).
    nonpersistent, sharded_state_dict = extract_nonpersistent(sharded_state_dict)
    dict_list_map_inplace(lambda obj: obj.unwrap(), nonpersistent)
    merge(common, nonpersistent)
    sharded_state_dict, _ = extract_sharded_base(sharded_state_dict)
    objects, tensors = extract_matching_values(
        sharded_state_dict, lambda v: isinstance(v, ShardedObject))

    def read_object(obj):
        file = _object_file(path, obj.unique_key)
        if file.is_file():
            return read_torch(file)
        log.warning("%s has no ShardedObject %s (saved under another layout?); keeping its "
                    "current value", path, obj.unique_key)
        return obj.data

    dict_list_map_inplace(lambda v: read_object(v) if isinstance(v, ShardedObject) else v,
                          objects)
    _on_host(tensors, copy=False)
    loaded = load_sharded_state_dict(tensors, path, replicas=replicas)
    merge(loaded, objects)
    merge(common, loaded)
    return common


def load_common_state_dict(checkpoint_dir: str | os.PathLike) -> dict:
    """Megatron-LM's plain values (args, iteration, scheduler) of a zarr checkpoint."""
    file = as_path(checkpoint_dir) / COMMON_FILE
    if not file.is_file():
        raise FileNotFoundError(
            f"{file} is missing: {checkpoint_dir} is not a complete Megatron-LM zarr "
            f"checkpoint; load another iteration")
    return read_torch(file)


def write_config(checkpoint_dir: str | os.PathLike) -> None:
    """Mark ``checkpoint_dir`` as a complete elastor zarr checkpoint (the last write)."""
    config = as_path(checkpoint_dir) / CONFIG_FILE
    storage_for(config).write_durably(config, json.dumps({
        "sharded_backend": BACKEND, "sharded_backend_version": BACKEND_VERSION,
        "common_backend": "torch", "common_backend_version": 1}))


def committed_iterations(save_dir: str | os.PathLike) -> list[int]:
    """Iterations of a Megatron-LM save directory that a load can resume, ascending:
    ``iter_*`` directories holding ``metadata.json`` (the last write of a zarr save and
    of mcore's own), up to the one the tracker names (written once a save completed;
    without a tracker, none). The directory or an ``s3://`` prefix."""
    root = as_path(save_dir)
    try:
        tracked = int((root / TRACKER_FILE).read_text().strip())
    except (FileNotFoundError, NotADirectoryError, ValueError):  # none yet, or "release"
        return []
    return sorted(int(m.group(1)) for entry in root.iterdir()
                  if (m := _ITER_RE.match(entry.name)) and int(m.group(1)) <= tracked
                  and backend_of(entry) is not None)


def prune(save_dir: Location, keep: int, just_saved: Location) -> None:
    """Delete all but the ``keep`` newest zarr ``iter_*`` checkpoints of ``save_dir``."""
    prune_oldest([(int(m.group(1)), entry) for entry in save_dir.iterdir()
                  if (m := _ITER_RE.match(entry.name)) and is_zarr_checkpoint(entry)],
                 keep, just_saved)


def _object_file(path: Location, unique_key: str) -> Location:
    return path / OBJECTS_DIR / f"{unique_key}.pt"


def object_files(checkpoint_dir: str | os.PathLike) -> dict[str, Location]:
    """``unique_key`` -> file of every ShardedObject saved in ``checkpoint_dir``."""
    root = as_path(checkpoint_dir) / OBJECTS_DIR
    names = storage_for(root).list_files(root)
    return {name[:-len(".pt")]: root / name for name in sorted(names)
            if name.endswith(".pt")}


def write_torch(value: Any, file: str | os.PathLike) -> None:
    """``torch.save`` into ``file``, a local path or an object-store URL."""
    write_file(as_path(file), _serialise(value))


def read_torch(file: str | os.PathLike) -> Any:
    """``torch.load`` of ``file``, a local path or an object-store URL (read again
    after a transient storage error)."""
    path = as_path(file)
    data = retrying(path.read_bytes, f"reading {path}")
    return torch.load(io.BytesIO(data), weights_only=False)


def _serialise(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()
