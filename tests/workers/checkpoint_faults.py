"""Worker: asynchronous saves on 2 ranks through ``FaultyStorage`` (tests/faulty_storage.py)
in front of a local root, so the writers' ``done``/``failed`` markers and the
committer's wait for them meet faults too.

Each rank holds half of a row-split tensor and a replica of a small one, saves after
every step with ``on_error='continue'``, and records what its manager reported. Then,
faults off, rank 0 checks every committed step against the state of its step. Each
rank writes ``result.rank<N>.json`` into ``--out``; the pytest side asserts on them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

STEPS = 16
ROWS, COLS = 64, 32


def state(rank: int, step: int) -> list:
    from elastor_mcore.checkpoint import LocalShard

    half = ROWS // 2
    generator = torch.Generator().manual_seed(step)
    w, norm = torch.randn(ROWS, COLS, generator=generator), torch.randn(COLS, generator=generator)
    return [LocalShard("w", (ROWS, COLS), (rank * half, 0), w[rank * half:(rank + 1) * half]),
            LocalShard("norm", (COLS,), (0,), norm)]


def main() -> None:
    from elastor_mcore import checkpoint as ck
    from elastor_mcore.checkpoint import storage
    from tests.faulty_storage import Faults, FaultyStorage

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--share", type=float, required=True)
    args = parser.parse_args()
    out = Path(args.out)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    faults = Faults(seed=11 + rank)
    backend = FaultyStorage(storage.storage_for(out / "ckpt"), faults)
    storage.register("faulty", backend)
    root = backend.url(out / "ckpt")

    manager = ck.CheckpointManager(root, policy=ck.SavePolicy(on_error="continue", keep=STEPS,
                                                              commit_timeout_floor_s=10))
    shards = state(rank, 0)
    faults.share = args.share
    for step in range(1, STEPS + 1):
        for shard, now in zip(shards, state(rank, step)):
            shard.data.copy_(now.data)
        manager.save(step, shards)
    manager.close()
    faults.share = 0.0

    result = {"rank": rank, "requests": faults.requests, "failed": dict(faults.failed),
              "reported": [str(e) for e in manager.failures], "last_step": step}
    if rank == 0:
        exact = {}
        for saved in ck.committed_steps(root):
            reader = ck.open(f"{root}/step_{saved:08d}")
            full = torch.cat([state(r, saved)[0].data for r in range(2)])
            exact[saved] = (torch.equal(reader.read("w"), full)
                            and torch.equal(reader.read("norm"), state(0, saved)[1].data))
        result.update(exact=exact, latest=ck.latest_step(root))
    (out / f"result.rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
