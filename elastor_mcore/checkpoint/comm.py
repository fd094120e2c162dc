"""The few collectives a save or load needs, and single-process fallbacks.

Every step that can fail locally ends in ``agree``: each rank contributes its error
(or ``None``) and all ranks raise together, so one rank's bad input or I/O error never
leaves the others hanging in the next collective (DCP's ``_DistWrapper`` idea).
Without an initialised process group everything runs as a world of one.
"""

from __future__ import annotations

from typing import Any

from elastor_mcore.checkpoint.format import CheckpointError
from elastor_mcore.geometry import ShardInfo
from elastor_mcore.parallel.shards import gather_shard_infos


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def global_rank() -> int:
    dist = _dist()
    return dist.get_rank() if dist else 0


def is_coordinator(group=None) -> bool:
    """Rank 0 of ``group`` commits: it writes metadata, the manifest and ``latest``."""
    dist = _dist()
    return dist is None or dist.get_rank(group) == 0


def all_gather(value: Any, group=None) -> list[Any]:
    """Every rank's ``value``, in group-rank order."""
    dist = _dist()
    if dist is None:
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def agree(error: BaseException | None, what: str, group=None) -> None:
    """Raise ``CheckpointError`` on every rank if any rank's ``error`` is set."""
    check(all_gather(describe(error), group), what, error)


def describe(error: BaseException | None) -> str | None:
    """This rank's contribution to ``check``."""
    return None if error is None else f"rank {global_rank()}: {error}"


def check(messages: list[str | None], what: str, cause: BaseException | None = None) -> None:
    """Raise ``CheckpointError`` naming every rank whose gathered message is set."""
    failures = [m for m in messages if m is not None]
    if failures:
        raise CheckpointError(f"{what} failed on {len(failures)} rank(s): "
                              + " | ".join(failures)) from cause


def gather_infos(local: list[ShardInfo], group=None) -> dict[int, list[ShardInfo]]:
    """Every rank's shard descriptions keyed by global rank (see ``parallel.shards``)."""
    if _dist() is None:
        return {0: list(local)}
    return gather_shard_infos(local, group)
