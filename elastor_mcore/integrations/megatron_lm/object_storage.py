"""Megatron-LM's ``--save`` / ``--load`` as an ``s3://BUCKET/PREFIX`` URL, for the
elastor zarr format (``--elastor-ckpt-format zarr``).

Megatron-LM's ``megatron/training/checkpointing.py`` touches the file system around the
save directory in a few places only; with a URL each of them goes to the object store
(endpoint and credentials from the AWS environment, ``checkpoint.storage``):

* creating ``iter_<N>/`` (``ensure_directory_exists``): prefixes need no creation;
* the tracker ``latest_checkpointed_iteration.txt``: its existence, its read and its
  write, one LIST, GET or PUT (core_v0.16.1 calls ``isfile`` and ``open_file``,
  core_v0.19.0 ``maybe_msc.os.path.isfile`` / ``exists`` and ``maybe_msc.open``);
* the format of a checkpoint to load (``_get_checkpoint_format`` lists the directory,
  ``check_is_distributed_checkpoint`` looks for ``metadata.json``): on object storage
  it must be an elastor zarr checkpoint.

The tensors, ``common.pt`` and the ShardedObjects go through the patched
``dist_checkpointing.save/load`` (``checkpoint.megatron_dir``), which take URLs; Megatron-LM
writes the tracker after the save is committed, as on a file system. Everything else
(``--save-retain-interval``'s ``shutil.rmtree``, torch_dist's own writer) stays local
and is refused for URLs when the arguments are parsed (``translate.check_checkpoint_flags``).
``hooks.PATCHES`` lists where each replacement goes.
"""

from __future__ import annotations

from elastor_mcore.checkpoint import megatron_dir
from elastor_mcore.checkpoint.format import CheckpointError
from elastor_mcore.checkpoint.storage import as_path, is_url, open_location


def wrap_is_distributed(original):
    def check_is_distributed_checkpoint(checkpoint_dir) -> bool:
        if not is_url(checkpoint_dir):
            return original(checkpoint_dir)
        return megatron_dir.backend_of(checkpoint_dir) is not None
    return check_is_distributed_checkpoint


def wrap_ensure_directory(original):
    def ensure_directory_exists(filename, check_parent=True):
        if not is_url(filename):
            return original(filename, check_parent)
        return None  # object-store prefixes need no creation
    return ensure_directory_exists


def wrap_isfile(original):
    def isfile(filename) -> bool:
        return as_path(filename).is_file() if is_url(filename) else original(filename)
    return isfile


def wrap_open(original):
    def open_file(path, mode="r", *args, **kwargs):
        if is_url(path):
            return open_location(path, mode)
        return original(path, mode, *args, **kwargs)
    return open_file


def wrap_checkpoint_format(original):
    def _get_checkpoint_format(checkpoint_name, args):
        if not is_url(checkpoint_name):
            return original(checkpoint_name, args)
        if megatron_dir.is_zarr_checkpoint(checkpoint_name):
            return "torch_dist"  # Megatron-LM's distributed path; the patched load reads it
        raise CheckpointError(
            f"{checkpoint_name} is not an elastor zarr checkpoint (no {megatron_dir.CONFIG_FILE} "
            f"naming {megatron_dir.BACKEND}): on object storage Megatron-LM loads only "
            f"checkpoints saved with --elastor-ckpt-format zarr")
    return _get_checkpoint_format


class ObjectStoreAwareClient:
    """core_v0.19.0's ``maybe_msc`` (Multi-Storage Client or the local file system),
    with object-store URLs served here; every other name and path goes to it."""

    def __init__(self, original) -> None:
        self._original = original

    def __getattr__(self, name: str):
        return getattr(self._original, name)

    def open(self, path, mode="r", *args, **kwargs):
        if is_url(path):
            return open_location(path, mode)
        return self._original.open(path, mode, *args, **kwargs)

    @property
    def os(self) -> "_Os":
        return _Os(self._original.os)


class _Os:
    def __init__(self, original) -> None:
        self._original = original
        self.path = _OsPath(original.path)

    def __getattr__(self, name: str):
        return getattr(self._original, name)

    def makedirs(self, name, *args, **kwargs):
        if not is_url(name):
            return self._original.makedirs(name, *args, **kwargs)
        return None


class _OsPath:
    def __init__(self, original) -> None:
        self._original = original

    def __getattr__(self, name: str):
        return getattr(self._original, name)

    def isfile(self, path) -> bool:
        return as_path(path).is_file() if is_url(path) else self._original.isfile(path)

    def exists(self, path) -> bool:
        return as_path(path).exists() if is_url(path) else self._original.exists(path)
