"""Worker: asynchronous saves through ``CheckpointManager`` on 2 ranks, no model.

Each rank holds one half of a row-split tensor and a replica of a small one. Cases:

* ``snapshots``: the ranks overwrite their tensors as soon as ``save`` returns; each
  committed step must still hold the values at the time of its save.
* ``skip``: a save due while the previous one is being written is skipped.
* ``full_disk`` (when ``--full`` names a small file system): a save that does not fit
  fails with ENOSPC; ``on_error='continue'`` logs it, ``'stop'`` raises it on every
  rank; the previous step stays loadable and the partial one is removed.

Rank 0 writes ``result.json`` into ``--out``; the pytest side asserts on it.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

ROWS, COLS = 512, 256


def state(rank: int, value: float, rows: int = ROWS) -> list:
    """This rank's half of ``w`` (rows x COLS, fp32) and a replica of ``norm``."""
    from elastor_mcore.checkpoint import LocalShard

    half = rows // 2
    return [LocalShard("w", (rows, COLS), (rank * half, 0),
                       torch.full((half, COLS), value + rank)),
            LocalShard("norm", (COLS,), (0,), torch.full((COLS,), value))]


def loads_as(root: Path, step: int, value: float, rows: int = ROWS) -> bool:
    """Whether step ``step`` under ``root`` holds ``state(r, value)`` of both ranks."""
    from elastor_mcore import checkpoint as ck

    reader = ck.open(root / f"step_{step:08d}")
    w, norm = reader.read("w"), reader.read("norm")
    half = rows // 2
    return (torch.equal(w[:half], torch.full((half, COLS), value))
            and torch.equal(w[half:], torch.full((half, COLS), value + 1))
            and torch.equal(norm, torch.full((COLS,), value)))


def snapshots(rank: int, root: Path) -> dict:
    from elastor_mcore import checkpoint as ck

    manager = ck.CheckpointManager(root, policy=ck.SavePolicy(keep=3))
    shards = state(rank, 0.0)
    blocks = []
    for step in (1, 2, 3):
        for shard in shards:
            shard.data.fill_(step + (rank if shard.key == "w" else 0))
        blocks.append(manager.save(step, shards).block_s)
        for shard in shards:  # "training" changes the state while the save writes
            shard.data.fill_(-1.0)
    manager.close()
    dist.barrier()
    return {"committed": ck.committed_steps(root),
            "exact": [loads_as(root, s, float(s)) for s in (1, 2, 3)],
            "block_s": blocks}


def skip(rank: int, root: Path) -> dict:
    from elastor_mcore import checkpoint as ck

    manager = ck.CheckpointManager(root, policy=ck.SavePolicy(when_busy="skip"))
    big = state(rank, 1.0, rows=16 * ROWS)
    first = manager.save(1, big)
    second = manager.save(2, big)
    manager.close()
    dist.barrier()
    return {"skipped": [first.skipped, second.skipped], "committed": ck.committed_steps(root)}


def full_disk(rank: int, root: Path) -> dict:
    """The file system under ``root`` holds the small state but not the large one."""
    from elastor_mcore import checkpoint as ck

    out = {}
    for on_error in ("continue", "stop"):
        where = root / on_error
        manager = ck.CheckpointManager(where, policy=ck.SavePolicy(on_error=on_error))
        manager.save(1, state(rank, 5.0, rows=64))
        manager.wait()
        manager.save(2, state(rank, 6.0, rows=16 * ROWS))
        raised = None
        try:
            manager.wait()
        except ck.CheckpointError as exc:
            raised = str(exc)
        dist.barrier()
        out[on_error] = {
            "raised": raised,
            "logged": [str(e) for e in manager.failures],
            "committed": ck.committed_steps(where),
            "leftovers": sorted(p.name for p in where.iterdir() if p.name.startswith(".tmp_")),
            "previous_loads": loads_as(where, 1, 5.0, rows=64),
        }
        dist.barrier()
        if rank == 0:
            shutil.rmtree(where)
        dist.barrier()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--full", default=None, help="a directory on a ~2 MB file system")
    args = parser.parse_args()
    out = Path(args.out)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {"snapshots": snapshots(rank, out / "snapshots"),
              "skip": skip(rank, out / "skip")}
    if args.full:
        result["full_disk"] = full_disk(rank, Path(args.full))
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    if rank == 0:
        (out / "result.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
