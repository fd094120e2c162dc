"""Helpers shared by the checkpoint tests: write-plan and read-amplification checks,
and small file systems for full-disk cases."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import subprocess
from pathlib import Path
from typing import Iterator

MAX_IMBALANCE = 1.25
MAX_READ_AMPLIFICATION = 1.1


def assert_units_tile(units, shapes: dict[str, tuple[int, ...]]) -> None:
    """Every element of every tensor is in exactly one write unit.

    ``units`` are ``(key, offset, shape, ...)`` rows: pairwise disjoint boxes whose
    sizes add up to the tensor is exactly a tiling.
    """
    by_key: dict[str, list] = {}
    for key, offset, shape, *_ in units:
        by_key.setdefault(key, []).append((tuple(offset), tuple(shape)))
    assert set(by_key) == set(shapes)
    for key, boxes in by_key.items():
        assert sum(math.prod(s) for _, s in boxes) == math.prod(shapes[key]), key
        for i, (o1, s1) in enumerate(boxes):
            for o2, s2 in boxes[i + 1:]:
                overlap = all(a < c + d and c < a + b for a, b, c, d in zip(o1, s1, o2, s2))
                assert not overlap, f"{key}: units at {o1} and {o2} overlap"


def assert_balanced(bytes_by_rank: dict) -> None:
    loads = list(bytes_by_rank.values())
    mean = sum(loads) / len(loads)
    assert max(loads) <= MAX_IMBALANCE * mean, bytes_by_rank


def amplification(bytes_read: int, bytes_needed: int) -> float:
    return bytes_read / bytes_needed


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str) -> Iterator[str | None]:
    """Mount a ``size`` tmpfs on ``where`` for a real ENOSPC; yields None when mounted,
    else why not (mounting needs root), so the caller can skip with that reason."""
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                            str(where)], capture_output=True, text=True)
    if mount.returncode:
        yield f"cannot mount a {size} tmpfs: {mount.stderr.strip() or 'not permitted'}"
        return
    try:
        yield None
    finally:
        subprocess.run(["umount", str(where)], check=False)


def write_world_result(out: Path, report: dict, plan, held) -> None:
    """Gather every rank's ``report`` and, on rank 0, write ``out/result.json`` with the
    reports and the save's write plan (bytes per rank; units as key, offset, shape,
    holders, writer; global shapes). No rank holds the whole plan: each unit and its
    writer come from the rank that wrote it, its holders from the ranks whose saved
    shards (``held``: this rank's ``(key, offset, shape)``) contain it, the entries
    from the coordinator (rank 0). Collective over the world."""
    import json

    import torch.distributed as dist

    from elastor_mcore.checkpoint import WritePlan
    from elastor_mcore.geometry import Box

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (report, [(k, Box(tuple(o), tuple(s))) for k, o, s in held],
                                      plan.units))
    if dist.get_rank() == 0:
        shards = {rank: boxes for rank, (_, boxes, _) in enumerate(gathered)}
        units = [dataclasses.replace(u, holders=tuple(
            r for r, boxes in shards.items()
            if any(k == u.key and box.contains(u.box) for k, box in boxes)))
            for _, _, written in gathered for u in written]
        whole = WritePlan(plan.entries, units)
        (out / "result.json").write_text(json.dumps(dict(
            ranks=[r for r, *_ in gathered],
            bytes_by_rank={str(k): v for k, v in whole.bytes_by_rank().items()},
            units=[[u.key, list(u.box.offset), list(u.box.shape), list(u.holders), u.writer]
                   for u in whole.units],
            shapes={k: list(e.shape) for k, e in whole.entries.items()})))
    dist.barrier()
