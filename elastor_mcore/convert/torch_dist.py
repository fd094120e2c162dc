"""Megatron-Core ``torch_dist`` checkpoints (as ``dist_checkpointing.save`` writes them)
to the elastor zarr format and back, one tensor at a time, in one process.

Keys follow mcore. Megatron-LM saves layers *stacked* (``decoder.layers.<rest>`` with
the layer as dim 0) and SwiGLU ``linear_fc1`` as one ``[gate; up]`` tensor; elastor
stores each layer under ``decoder.layers.<i>.<rest>`` and ``linear_fc1`` as its
``weight_w`` (gate) / ``weight_v`` (up) halves, as mcore's own per-layer form names
them. Per-layer torch_dist checkpoints (``singleton_local_shards``) map one to one.
Which form the source had is recorded in the manifest, so the way back restores it.

Megatron-LM's plain state (``common.pt``) and ShardedObjects travel as the Megatron
zarr format stores them (``checkpoint.megatron_dir``), so a converted checkpoint also resumes
a Megatron-LM run started with ``--elastor-ckpt-format zarr``.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.checkpoint import (
    DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader, FileSystemWriter)
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from elastor_mcore.checkpoint import megatron_dir
from elastor_mcore.checkpoint import CheckpointError, ChunkPolicy
from elastor_mcore.checkpoint import open as open_checkpoint
from elastor_mcore.checkpoint.storage import Location, as_path
from elastor_mcore.compat.mcore import (
    torch_dist_common_in_dcp, torch_dist_common_object, torch_dist_common_object_key,
    torch_dist_common_state)
from elastor_mcore.convert.zarr_io import Progress, StreamingZarrWriter

log = logging.getLogger(__name__)

SOURCE_KEY = "converted_from"
_STACKED = re.compile(r"^(?P<prefix>(?:.*\.)?decoder\.layers\.)(?P<rest>[^0-9].*)$")
_PER_LAYER = re.compile(r"^(?P<prefix>(?:.*\.)?decoder\.layers\.)(?P<layer>\d+)\.(?P<rest>.+)$")
_FC1 = "mlp.linear_fc1.weight"
_HALVES = ("_w", "_v")


@dataclass(frozen=True)
class _Piece:
    """Where a slice of a source tensor goes: ``index`` selects it from the source."""

    key: str
    index: tuple


def _pieces(key: str, shape: tuple[int, ...]) -> list[_Piece]:
    """The elastor tensors one torch_dist tensor becomes."""
    match = _STACKED.match(key)
    if not match:
        return [_Piece(key, ())]
    prefix, rest = match["prefix"], match["rest"]
    out = []
    for layer in range(shape[0]):
        if rest.endswith(_FC1):
            half = shape[1] // 2
            out += [_Piece(f"{prefix}{layer}.{rest}{suffix}",
                           (layer, slice(i * half, (i + 1) * half)))
                    for i, suffix in enumerate(_HALVES)]
        else:
            out.append(_Piece(f"{prefix}{layer}.{rest}", (layer,)))
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def is_torch_dist(path: str | os.PathLike) -> bool:
    return megatron_dir.backend_of(path) == "torch_dist"


def torch_dist_to_zarr(src: str | os.PathLike, dst: str | os.PathLike, *,
                       manifest_extra: dict[str, Any] | None = None,
                       chunking: ChunkPolicy | None = None,
                       progress: Progress | None = None) -> Path:
    """Convert the torch_dist checkpoint directory ``src`` into ``dst`` (a new
    Megatron zarr checkpoint directory, or an object-store URL). Reads and writes one
    tensor at a time."""
    src, dst = Path(src), as_path(dst)
    if not is_torch_dist(src):
        raise CheckpointError(f"{src} is not a torch_dist checkpoint (its metadata.json "
                              f"does not name sharded_backend torch_dist)")
    reader = FileSystemReader(os.fspath(src))
    metadata = reader.read_metadata().state_dict_metadata
    sources = {k: m for k, m in metadata.items() if isinstance(m, TensorStorageMetadata)}
    # mcore >= 0.19 keeps the common state as an object; it travels as common.pt.
    common_key = torch_dist_common_object_key()
    objects = sorted(k for k in metadata if k not in sources and k != common_key)
    common = torch_dist_common_state(
        src, lambda key: _read_items(reader, {key: io.BytesIO()})[key]
        if key in metadata else None)
    declared, stacked = {}, {}
    for key, meta in sources.items():
        pieces = _pieces(key, tuple(meta.size))
        if pieces[0].index:
            stacked[key] = list(meta.size)
        probe = torch.empty(tuple(meta.size), dtype=meta.properties.dtype, device="meta")
        for piece in pieces:
            declared[piece.key] = (tuple(probe[piece.index].shape),
                                   _dtype_name(meta.properties.dtype))
    extra = dict(manifest_extra or {})
    extra[SOURCE_KEY] = {"format": "torch_dist", "stacked": stacked}
    writer = StreamingZarrWriter(dst, declared, step=_iteration(common), manifest_extra=extra,
                                 chunking=chunking)
    for done, key in enumerate(sorted(sources), 1):
        meta = sources[key]
        tensor = _read_items(reader, {key: torch.empty(tuple(meta.size),
                                                        dtype=meta.properties.dtype)})[key]
        for piece in _pieces(key, tuple(meta.size)):
            writer.write(piece.key, tensor[piece.index])
        del tensor
        if progress:
            progress(done, len(sources), key)
    writer.commit()
    megatron_dir.write_torch(with_layer_keys(common, per_layer=True),
                             dst / megatron_dir.COMMON_FILE)
    for key, data in _read_items(reader, {k: io.BytesIO() for k in objects}).items():
        # mcore stores a ShardedObject as torch.save([data]); megatron_dir as data.
        megatron_dir.write_torch(torch.load(io.BytesIO(data), weights_only=False)[0],
                                 dst / megatron_dir.OBJECTS_DIR / f"{key}.pt")
    megatron_dir.write_config(dst)
    log.info("converted %s: %d tensors (%d stacked), %d objects -> %s", src, len(sources),
             len(stacked), len(objects), dst)
    return dst


def zarr_to_torch_dist(src: str | os.PathLike, dst: str | os.PathLike, *,
                       stacked: bool | None = None,
                       progress: Progress | None = None) -> Path:
    """Convert an elastor checkpoint (a local directory or an object-store URL) into
    a torch_dist directory ``dst``.

    ``stacked`` chooses Megatron-LM's default stacked layer keys (True) or mcore's
    per-layer keys (False); None restores what the checkpoint was converted from
    (stacked if it was not converted from torch_dist: Megatron-LM's default).
    """
    reader = open_checkpoint(src)
    dst = Path(dst)
    source = reader.manifest.extra.get(SOURCE_KEY) or {}
    if stacked is None:
        stacked = source.get("format") != "torch_dist" or bool(source.get("stacked"))
    outputs = _stack_plan(reader) if stacked else {
        key: (entry.shape, entry.dtype, [(key, ())])
        for key, entry in reader.manifest.tensors.items()}
    objects = megatron_dir.object_files(reader.path)
    state: dict[str, Any] = {
        key: torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
        for key, (shape, dtype, _) in outputs.items()}
    state.update({key: io.BytesIO(_mcore_object_bytes(file)) for key, file in objects.items()})
    common_file = as_path(reader.path) / megatron_dir.COMMON_FILE
    common = megatron_dir.read_torch(common_file) if common_file.is_file() \
        else {"iteration": reader.manifest.step}
    common = with_layer_keys(common, per_layer=not stacked)
    if torch_dist_common_in_dcp():  # where the installed mcore's own save puts it
        state[torch_dist_common_object_key()] = io.BytesIO(torch_dist_common_object(common))

    def assemble(key: str) -> torch.Tensor:
        shape, dtype, parts = outputs[key]
        if len(parts) == 1 and parts[0][1] == ():
            return reader.read(parts[0][0])
        out = torch.empty(shape, dtype=getattr(torch, dtype))
        for part_key, index in parts:
            out[index] = reader.read(part_key)
        return out

    if dst.exists() and any(dst.iterdir()):
        raise CheckpointError(f"{dst} exists and is not empty; choose a new directory")
    dst.mkdir(parents=True, exist_ok=True)
    dcp_save(state, storage_writer=FileSystemWriter(os.fspath(dst), single_file_per_rank=True,
                                                thread_count=1),
         planner=_StreamingSavePlanner(assemble, len(outputs), progress), no_dist=True)
    if not torch_dist_common_in_dcp():
        torch.save(common, dst / megatron_dir.COMMON_FILE)
    (dst / megatron_dir.CONFIG_FILE).write_text(json.dumps(
        {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
         "common_backend": "torch", "common_backend_version": 1}))
    log.info("converted %s -> %s: %d tensors (%s layer keys), %d objects", reader.path, dst,
             len(outputs), "stacked" if stacked else "per-layer", len(objects))
    return dst


def with_layer_keys(common: dict, per_layer: bool) -> dict:
    """``common`` whose Megatron-LM content metadata names the layer keys written
    (``singleton_local_shards``): Megatron-LM builds its load request from it, and a
    conversion changes the form (the zarr side holds per-layer keys)."""
    metadata = common.get(megatron_dir.CONTENT_METADATA_KEY)
    if not isinstance(metadata, dict) or "singleton_local_shards" not in metadata:
        return common  # not Megatron-LM's metadata (it always names the layer keys)
    return {**common, megatron_dir.CONTENT_METADATA_KEY: {
        **metadata, "singleton_local_shards": per_layer}}


def _stack_plan(reader) -> dict[str, tuple[tuple[int, ...], str, list[tuple[str, tuple]]]]:
    """Output key -> (shape, dtype, [(elastor key, index into the output)])."""
    groups: dict[str, dict[int, list[str]]] = {}
    outputs: dict[str, tuple[tuple[int, ...], str, list]] = {}
    for key, entry in sorted(reader.manifest.tensors.items()):
        match = _PER_LAYER.match(key)
        if not match:
            outputs[key] = (entry.shape, entry.dtype, [(key, ())])
            continue
        rest = match["rest"]
        if any(rest == _FC1 + h or rest.endswith("." + _FC1 + h) for h in _HALVES):
            rest = rest[:-2]
        groups.setdefault(match["prefix"] + rest, {}).setdefault(
            int(match["layer"]), []).append(key)
    for out_key, layers in groups.items():
        if sorted(layers) != list(range(len(layers))):
            raise CheckpointError(f"{reader.path}: layers {sorted(layers)} of {out_key} are "
                                  f"not 0..N-1; cannot stack them")
        first = reader.manifest.tensors[sorted(layers[0])[0]]
        parts: list[tuple[str, tuple]] = []
        if len(layers[0]) == 2:  # linear_fc1 halves: [gate; up] along dim 0
            half = first.shape[0]
            shape = (len(layers), 2 * half, *first.shape[1:])
            for layer, keys in layers.items():
                for i, suffix in enumerate(_HALVES):
                    key = next(k for k in keys if k.endswith(suffix))
                    parts.append((key, (layer, slice(i * half, (i + 1) * half))))
        else:
            shape = (len(layers), *first.shape)
            parts = [(keys[0], (layer,)) for layer, keys in layers.items()]
        outputs[out_key] = (shape, first.dtype, parts)
    return outputs


def _mcore_object_bytes(file: Location) -> bytes:
    buffer = io.BytesIO()
    torch.save([megatron_dir.read_torch(file)], buffer)
    return buffer.getvalue()


def _iteration(common: dict) -> int:
    iteration = common.get("iteration", 0)
    return iteration if isinstance(iteration, int) and iteration >= 0 else 0


class _RawBytesPlanner(DefaultLoadPlanner):
    """Keeps bytes items as raw ``bytes`` (in ``raw``) instead of unpickling them."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False)
        self.raw: dict[str, bytes] = {}

    def load_bytes(self, read_item, value):
        self.raw[read_item.dest_index.fqn] = value.read()


def _read_items(reader, state: dict[str, Any]) -> dict[str, Any]:
    """Load ``state``'s keys: tensors in place, bytes objects returned as ``bytes``."""
    if not state:
        return state
    planner = _RawBytesPlanner()
    dcp_load(state, storage_reader=reader, planner=planner, no_dist=True)
    return {**state, **planner.raw}


class _StreamingSavePlanner(DefaultSavePlanner):
    """Materialises each tensor only when the writer asks for it (the state dict
    holds ``meta`` placeholders), so one tensor at a time is in memory. Objects are
    written as the bytes given, not pickled again."""

    def __init__(self, assemble: Callable[[str], torch.Tensor], total: int,
                 progress: Progress | None) -> None:
        super().__init__()
        self.assemble, self.total, self.progress, self.done = assemble, total, progress, 0

    def resolve_data(self, write_item):
        value = self.lookup_object(write_item.index)
        if isinstance(value, io.BytesIO):  # already serialised, as mcore stores objects
            value.seek(0)
            return value
        tensor = self.assemble(write_item.index.fqn)
        self.done += 1
        if self.progress:
            self.progress(self.done, self.total, write_item.index.fqn)
        return tensor
