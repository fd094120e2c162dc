"""Worker: library-level save/load across 4 ranks, no mcore model.

Saves from TP-4-style boxes where every quarter has two holders (replicas), then
loads into halves, 3-way uneven boxes and whole tensors (bf16 and fp32, bit-exact),
saves from a sub-group that excludes rank 0, and measures bytes read; then loads
with replica classes under seeded random layouts (compared with a single-process read)
and with a false class and classes that differ between ranks (each must fail), counting
their job-wide calls; saves of disjoint state with a grid, right and wrong; saves and
loads of mixed state (replica classes beside a grid, with named files); saves with
seeded replica classes, classes of one among them. The loads run
twice: as they are (one host: replicas share the page cache and read their own
bytes), and as if every rank ran on its own host (replicas share reads over gloo); on
object storage once (every rank is its own host there). Rank 0 writes
``result.json`` into ``--out``; the pytest side asserts on it.
"""

from __future__ import annotations

import argparse
import contextlib
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

from tests.checkpoint_checks import write_world_result

# key -> (global shape, dtype, split dim or None for replicated)
TENSORS = {
    "decoder.layers.0.mlp.linear_fc1.weight_w": ((192, 64), torch.float32, 0),
    "decoder.layers.0.mlp.linear_fc2.weight": ((64, 192), torch.bfloat16, 1),
    "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": ((64,), torch.float32, None),
    "embedding.word_embeddings.weight": ((512, 64), torch.bfloat16, 0),
    "optimizer.exp_avg.embedding.word_embeddings.weight": ((512, 64), torch.float32, 0),
}


def truth(key: str) -> torch.Tensor:
    shape, dtype, _ = TENSORS[key]
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.randn(shape, generator=g).to(dtype)


def piece(key: str, dim: int | None, lo: int, hi: int, fill: float | None = None):
    """A LocalShard of rows/cols [lo, hi) along ``dim`` (the whole tensor if None)."""
    from elastor_mcore.checkpoint import LocalShard

    full = truth(key)
    shape = TENSORS[key][0]
    offset = [0] * len(shape)
    data = full
    if dim is not None:
        offset[dim] = lo
        data = full.narrow(dim, lo, hi - lo)
    data = data.clone() if fill is None else torch.full_like(data, fill)
    return LocalShard(key, shape, tuple(offset), data)


def split_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    return [(i * n // parts, (i + 1) * n // parts) for i in range(parts)]


def save_boxes(rank: int) -> list:
    """TP-4 quarters; rank r holds quarters r and r+1 (mod 4): every quarter twice."""
    shards = []
    for key, (shape, _, dim) in TENSORS.items():
        if dim is None:
            shards.append(piece(key, None, 0, 0))
            continue
        quarters = split_bounds(shape[dim], 4)
        for q in (rank, (rank + 1) % 4):
            shards.append(piece(key, dim, *quarters[q]))
    return shards


def load_boxes(rank: int, how: str) -> list:
    """Empty destination shards for one target layout."""
    targets = []
    for key, (shape, _, dim) in TENSORS.items():
        if dim is None or how == "whole" or (how == "uneven" and rank == 3):
            targets.append(piece(key, None, 0, 0, fill=-7.0))
        elif how == "halves":
            targets.append(piece(key, dim, *split_bounds(shape[dim], 2)[rank % 2], fill=-7.0))
        elif how == "uneven":
            n = shape[dim]
            cuts = [0, n // 4 + 3, n // 2 + 7, n]
            targets.append(piece(key, dim, cuts[rank], cuts[rank + 1], fill=-7.0))
    return targets


COUNTED = ("all_to_all_single", "all_reduce", "all_gather_object", "broadcast_object_list")
"""The collectives ``counting`` counts (every job-wide call ``checkpoint.comm`` makes)."""


@contextlib.contextmanager
def counting():
    """The calls of each of ``COUNTED`` made inside the block, by name."""
    calls = dict.fromkeys(COUNTED, 0)
    real = {name: getattr(dist, name) for name in COUNTED}

    def counted(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return real[name](*args, **kwargs)
        return call
    for name in COUNTED:
        setattr(dist, name, counted(name))
    try:
        yield calls
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


def mismatches(targets) -> list[str]:
    """Targets whose bits differ from the global truth."""
    from elastor_mcore.geometry import Box, local_view

    bad = []
    for t in targets:
        full = truth(t.key)
        want = local_view(full, Box((0,) * full.dim(), tuple(full.shape)), t.box)
        ints = {2: torch.int16, 4: torch.int32}[want.element_size()]
        if not torch.equal(t.data.view(ints), want.contiguous().view(ints)):
            bad.append(f"{t.key} {t.box}")
    return bad


CLASS_SEEDS = range(6)
"""The seeded random layouts of the replica-class passes (``class_targets``,
``class_shards``)."""


def seeded_classes(seed: int) -> list[tuple[int, ...]]:
    """Seeded random replica classes of the 4 ranks, in a random order (classes of one
    included)."""
    import random

    rng = random.Random(seed)
    order = rng.sample(range(4), 4)
    sizes = rng.choice([(2, 2), (3, 1), (2, 1, 1), (4,), (1, 1, 2)])
    classes, start = [], 0
    for size in sizes:
        classes.append(tuple(sorted(order[start:start + size])))
        start += size
    return classes


def class_targets(seed: int, rank: int):
    """``seeded_classes``, each class's targets the same random boxes (cuts along each
    tensor's split dimension, or the whole tensor; a class may hold nothing: idle
    ranks): this rank's targets and every rank's classes."""
    import random

    from elastor_mcore.checkpoint import Replicas

    classes = seeded_classes(seed)
    mine = next(i for i, members in enumerate(classes) if rank in members)
    local = random.Random(seed * 100 + mine)
    targets = []
    if local.random() < 0.15:
        return targets, Replicas(tuple(sorted(classes)))
    for key, (shape, _, dim) in TENSORS.items():
        if dim is None or local.random() < 0.2:
            targets.append(piece(key, None, 0, 0, fill=-7.0))
            continue
        cuts = sorted(local.sample(range(1, shape[dim]), 2))
        lo, hi = local.choice([(0, cuts[0]), (cuts[0], cuts[1]), (cuts[1], shape[dim]),
                               (0, cuts[1])])
        targets.append(piece(key, dim, lo, hi, fill=-7.0))
    return targets, Replicas(tuple(sorted(classes)))


def class_shards(seed: int, rank: int):
    """``seeded_classes``, the members of each class holding the same shards: each
    split tensor cut at seeded random points into a piece per class, the replicated
    one whole on every rank; this rank's shards and every rank's classes."""
    import random

    from elastor_mcore.checkpoint import Replicas

    classes = seeded_classes(seed)
    mine = next(i for i, members in enumerate(classes) if rank in members)
    rng = random.Random(seed + 1000)
    shards = []
    for key, (shape, _, dim) in TENSORS.items():
        if dim is None:
            shards.append(piece(key, None, 0, 0))
            continue
        ends = [0, *sorted(rng.sample(range(1, shape[dim]), len(classes) - 1)), shape[dim]]
        shards.append(piece(key, dim, ends[mine], ends[mine + 1]))
    return shards, Replicas(tuple(sorted(classes)))


def class_saves(root: str, rank: int, policy) -> dict:
    """Saves with replica classes (``save(..., replicas=)``, as the trainer saves
    without ZeRO-1) under ``seeded_classes``: how many columns plan each tensor, the
    job-wide calls, and what a single-process read of the step finds."""
    from elastor_mcore import checkpoint as ck

    out = {}
    for seed in CLASS_SEEDS:
        shards, replicas = class_shards(seed, rank)
        with counting() as calls:
            ck.save(f"{root}/classes-{seed}", 1, shards, {}, chunking=policy,
                    replicas=replicas)
        bad, _ = single_process_read(f"{root}/classes-{seed}",
                                     [piece(key, None, 0, 0) for key in TENSORS])
        out[seed] = dict(classes=[list(c) for c in replicas.classes],
                         columns=replicas.columns, mismatches=bad, calls=calls)
    return out


def single_process_read(path: str, targets) -> tuple[list[str], int]:
    """Targets whose bits differ from a single-process read of the checkpoint, and the
    bytes that read took from storage (what one rank alone reads for them)."""
    from elastor_mcore import checkpoint as ck

    reader = ck.open(path)
    bad = []
    before = ck.storage_bytes_read()
    for t in targets:
        want = reader.read(t.key, t.box)
        ints = {2: torch.int16, 4: torch.int32}[want.element_size()]
        if not torch.equal(t.data.view(ints), want.view(ints)):
            bad.append(f"{t.key} {t.box}")
    return bad, ck.storage_bytes_read() - before


def class_loads(root: str, rank: int) -> dict:
    """Loads with replica classes (``load(..., replicas=)``) under seeded random
    layouts, each as one host and as a host per rank; a false class (members holding
    different boxes) and classes that differ between ranks, each of which must fail
    on every rank with ``CheckpointError``."""
    from elastor_mcore import checkpoint as ck
    from elastor_mcore.checkpoint import Replicas, reader

    out: dict = {"seeds": {}}
    real_page_cache = reader.page_cache_id
    for seed in CLASS_SEEDS:
        targets, replicas = class_targets(seed, rank)
        hosts = "a host per rank" if seed % 2 else "one host"
        reader.page_cache_id = (lambda: f"host {rank}") if seed % 2 else real_page_cache
        before = ck.storage_bytes_read()
        with counting() as calls:
            ck.load(f"{root}/world", targets, replicas=replicas)
        read = ck.storage_bytes_read() - before
        bad, alone = single_process_read(f"{root}/world", targets)
        out["seeds"][seed] = dict(hosts=hosts, classes=[list(c) for c in replicas.classes],
                                  mismatches=bad, bytes_read=read, bytes_alone=alone,
                                  calls=calls)
    reader.page_cache_id = lambda: f"host {rank}"
    out["disjoint"] = disjoint_loads(root, rank)
    for name, targets, replicas in (
            ("false class", load_boxes(rank, "halves"), Replicas(((0, 1), (2, 3)))),
            ("classes differ between ranks", load_boxes(rank, "halves"),
             Replicas(((0, 2), (1, 3)) if rank else ((0, 1), (2, 3))))):
        try:
            ck.load(f"{root}/world", targets, replicas=replicas)
            out[name] = "loaded"
        except ck.CheckpointError as exc:
            out[name] = str(exc)
    reader.page_cache_id = real_page_cache
    return out


def disjoint_boxes(rank: int) -> list:
    """Targets no two ranks share (ZeRO-1's state): uneven rows or columns of each
    split tensor, the replicated one on rank 0 only."""
    targets = []
    for key, (shape, _, dim) in TENSORS.items():
        if dim is None:
            if rank == 0:
                targets.append(piece(key, None, 0, 0, fill=-7.0))
            continue
        n = shape[dim]
        cuts = [0, n // 4 + 3, n // 2 + 7, 3 * n // 4 + 1, n]
        targets.append(piece(key, dim, cuts[rank], cuts[rank + 1], fill=-7.0))
    return targets


def disjoint_loads(root: str, rank: int) -> dict:
    """Loads with ``Replicas(disjoint=True)`` (as the trainer passes under ZeRO-1),
    counting the ``all_to_all_single`` calls (the owners' plan) they make: of
    disjoint targets, and of targets that overlap after all (each rank then reads its
    own: the bytes must still be right)."""
    from elastor_mcore import checkpoint as ck
    from elastor_mcore.checkpoint import Replicas

    with counting() as calls:
        targets = disjoint_boxes(rank)
        before = ck.storage_bytes_read()
        ck.load(f"{root}/world", targets, replicas=Replicas(disjoint=True))
        read = ck.storage_bytes_read() - before
        overlapping = load_boxes(rank, "halves")
        ck.load(f"{root}/world", overlapping, replicas=Replicas(disjoint=True))
    _, alone = single_process_read(f"{root}/world", targets)
    return dict(mismatches=mismatches(targets), overlapping_mismatches=mismatches(overlapping),
                all_to_all=calls["all_to_all_single"], bytes_read=read, bytes_alone=alone,
                held=sum(t.data.numel() for t in targets))


def grid_boxes(rank: int, policy, shift: int = 0) -> tuple[list, dict]:
    """ZeRO-1-like state: each split tensor's dim cut unevenly among the ranks at the
    file boundaries of the TP-4 quarters' save (``shift`` moves the inner cuts that
    many elements off them), the replicated one on rank 0 only; and the grid every
    rank passes (the quarters' cut points)."""
    from elastor_mcore.checkpoint.format import choose_entry

    shards, grid = [], {}
    for key, (shape, dtype, dim) in TENSORS.items():
        cuts = [[0, n] for n in shape]
        if dim is not None:
            cuts[dim] = sorted({a for bounds in split_bounds(shape[dim], 4) for a in bounds})
        grid[key] = cuts
        if dim is None:
            shards += [piece(key, None, 0, 0)] if rank == 0 else []
            continue
        dtype_name = str(dtype).removeprefix("torch.")
        file = choose_entry(shape, dtype_name, cuts, policy).shard[dim]
        files = shape[dim] // file
        ends = [0, *(min(files, f) * file + shift for f in (files // 4 + 1, files // 2 + 1,
                                                            3 * files // 4)), shape[dim]]
        shards.append(piece(key, dim, ends[rank], ends[rank + 1]))
    return shards, grid


def disjoint_saves(root: str, rank: int, policy) -> dict:
    """Saves of disjoint state with a grid (``Replicas.grid``, as the trainer saves
    ZeRO-1's): the job-wide calls they make (``counting``: the entries' gather to the
    coordinator, then the finish), what a single-process read finds, and the error of
    each wrong claim (every rank must raise): shards cut off the files, a rank that
    also holds another's shard (a file written twice), a rank that holds nothing (files
    never written), bad shards on two ranks (their errors travel in the gather)."""
    from elastor_mcore import checkpoint as ck
    from elastor_mcore.checkpoint import LocalShard, Replicas

    shards, grid = grid_boxes(rank, policy)
    with counting() as calls:
        ck.save(f"{root}/disjoint", 5, shards, {}, chunking=policy,
                replicas=Replicas(disjoint=True, grid=grid))
    whole = [piece(key, None, 0, 0) for key in TENSORS]  # the truth, whole
    bad, _ = single_process_read(f"{root}/disjoint", whole)
    out = dict(calls=calls, mismatches=bad, held=len(shards),
               entries_match=ck.open(f"{root}/disjoint").manifest.tensors
               == ck.open(f"{root}/world").manifest.tensors)
    # the trainer's saves are asynchronous: the same plan through CheckpointManager,
    # the files' count checked by the coordinator after the others' done markers
    saver = ck.CheckpointManager(f"{root}/disjoint-async", chunking=policy,
                                 policy=ck.SavePolicy(asynchronous=True, on_error="stop"),
                                 replicas=Replicas(disjoint=True, grid=grid))
    with counting() as calls:
        saver.save(7, shards, {})
        saver.close()
    out["async_all_to_all"] = calls["all_to_all_single"]
    out["async_mismatches"] = single_process_read(f"{root}/disjoint-async", whole)[0]
    saver.save(8, [] if rank == 3 else shards, {})
    try:
        saver.close()
        out["async files never written"] = "saved"
    except ck.CheckpointError as exc:
        out["async files never written"] = str(exc)
    others = grid_boxes((rank + 1) % 4, policy)[0]
    key = "embedding.word_embeddings.weight"
    outside = LocalShard(key, TENSORS[key][0], (510, 0), truth(key)[:4])  # rows 510-513 of 512
    for name, wrong in (("off the files", grid_boxes(rank, policy, shift=1)[0]),
                        ("a file twice", shards + (others if rank == 1 else [])),
                        ("files never written", [] if rank == 3 else shards),
                        ("bad shards on two ranks", shards + ([outside] if rank in (0, 2)
                                                              else []))):
        try:
            ck.save(f"{root}/disjoint", 6, wrong, {}, chunking=policy,
                    replicas=Replicas(disjoint=True, grid=grid))
            out[name] = "saved"
        except ck.CheckpointError as exc:
            out[name] = str(exc)
    return out


MIXED_SEEDS = range(4)
"""The seeded random layouts of the mixed-state pass (``mixed_state``)."""
GRID_KEY = "optimizer.exp_avg.embedding.word_embeddings.weight"
"""A tensor the mixed-state pass holds as ZeRO-1 state (disjoint, on a grid)."""
AWAY_KEY = "decoder.layers.0.mlp.linear_fc1.weight_w"
"""Another, which the coordinator holds none of (a later stage's state): its entry
reaches the coordinator only in the plan's first exchange."""


def mixed_state(seed: int, rank: int, policy) -> tuple[list, object, dict]:
    """Megatron-LM's state under a heterogeneous layout with ZeRO-1, in small: seeded
    random replica classes (classes of one included) whose members hold the same
    boxes of every other tensor (each class a random segment of a random partition
    of each split tensor, or the whole of it: the classes together cover it), and
    ``GRID_KEY`` cut at its grid's files among the ranks, disjoint (its first file, whose
    writer creates its array, on rank ``-seed % 4``), and ``AWAY_KEY`` so among ranks
    1-3; named files that
    every member of a class offers (the same bytes: a ShardedObject of its stage) and
    one that rank 0 alone offers (``common.pt``). Returns this rank's shards, the
    replicas every rank passes and the files it offers."""
    import random

    from elastor_mcore.checkpoint import Replicas

    rng = random.Random(1000 + seed)
    order = rng.sample(range(4), 4)
    sizes = rng.choice([(2, 2), (3, 1), (2, 1, 1), (1, 1, 2), (4,)])
    classes, start = [], 0
    for size in sizes:
        classes.append(tuple(sorted(order[start:start + size])))
        start += size
    classes.sort()
    mine = next(i for i, members in enumerate(classes) if rank in members)
    from elastor_mcore.checkpoint.format import choose_entry

    grid_shards, grid = grid_boxes((rank + seed) % 4, policy)  # the first file: rank -seed
    shards = [s for s in grid_shards if s.key == GRID_KEY]
    rows = TENSORS[AWAY_KEY][0][0]
    file = choose_entry(TENSORS[AWAY_KEY][0], "float32", grid[AWAY_KEY], policy).shard[0]
    ends = [0, rows // file // 3 * file, 2 * rows // file // 3 * file, rows]
    shards += [piece(AWAY_KEY, 0, ends[rank - 1], ends[rank])] if rank else []
    for key, (shape, _, dim) in TENSORS.items():
        if key in (GRID_KEY, AWAY_KEY):
            continue
        if dim is None or rng.random() < 0.2:
            shards.append(piece(key, None, 0, 0))
            continue
        cuts = sorted(rng.sample(range(1, shape[dim]), len(classes) - 1))
        bounds = list(zip([0, *cuts], [*cuts, shape[dim]]))
        rng.shuffle(bounds)
        shards.append(piece(key, dim, *bounds[mine]))
    files = {f"objects/class{classes[mine][0]}.pt": f"stage of {classes[mine]}".encode()}
    if rank == 0:
        files["common.pt"] = b"plain values"
    return shards, Replicas(tuple(classes), grid={k: grid[k] for k in (GRID_KEY, AWAY_KEY)}), files


def mixed_saves(root: str, rank: int, policy) -> dict:
    """Saves and loads of mixed state (``mixed_state``), as Megatron-LM's zarr saves
    pass it: per seed, the job-wide calls of the save (two exchanges, then the finish)
    and of a load with the same replicas (two ``all_reduce``s), what a single-process
    read finds, the grid tensor's entry against the replicated save's, which rank
    wrote each named file and what it holds; then a member whose weights differ from
    its class's, and a grid shard off its files: each must fail on every rank."""
    from elastor_mcore import checkpoint as ck
    from elastor_mcore.checkpoint import writer

    out: dict = {"seeds": {}}
    whole = [piece(key, None, 0, 0) for key in TENSORS]
    world_entry = ck.open(f"{root}/world").manifest.tensors[GRID_KEY]
    for seed in MIXED_SEEDS:
        shards, replicas, files = mixed_state(seed, rank, policy)
        with counting() as calls:
            result = writer.write_checkpoint(f"{root}/mixed/step_{seed}", seed, shards, {},
                                             chunking=policy, replicas=replicas, files=files)
        step = f"{root}/mixed/step_{seed}"
        targets = [piece(s.key, None, 0, 0, fill=-7.0) if s.key not in replicas.grid else
                   piece(s.key, 0, s.global_offset[0], s.global_offset[0] + s.data.shape[0],
                         fill=-7.0) for s in shards]
        with counting() as load_calls:
            ck.load(step, targets, replicas=replicas)
        out["seeds"][seed] = dict(
            classes=[list(c) for c in replicas.classes], calls=calls, load_calls=load_calls,
            mismatches=single_process_read(step, whole)[0], load_mismatches=mismatches(targets),
            grid_entry_matches=ck.open(step).manifest.tensors[GRID_KEY] == world_entry,
            files_written=list(result.plan.files),
            files={name: (Path(step) / name).read_bytes().decode()
                   for name in sorted(files) if (Path(step) / name).is_file()},
            offered=sorted(files))
    shards, replicas, files = mixed_state(3, rank, policy)  # ranks 0 and 1 a class
    assert (0, 1) in replicas.classes
    other = [piece(s.key, None, 0, 0) if s.key not in replicas.grid and rank == 1 else s
             for s in shards]
    off = [s for s in grid_boxes((rank + 3) % 4, policy, shift=1)[0] if s.key == GRID_KEY] + [
        s for s in shards if s.key != GRID_KEY]
    for name, wrong in (("member off its class", other), ("grid shard off its files", off)):
        try:
            writer.write_checkpoint(f"{root}/mixed/wrong", 9, wrong, {}, chunking=policy,
                                    replicas=replicas, files=files)
            out[name] = "saved"
        except ck.CheckpointError as exc:
            out[name] = str(exc)
    return out


EXCHANGE_SEEDS = range(3)
"""The seeded rounds of ``exchanges``."""


def exchange_message(seed: int, sender: int, dest: int) -> bytes | None:
    """What ``sender`` sends ``dest`` in round ``seed`` of ``exchanges``: nothing, or
    random bytes of a random size (0 to 300 KB, so most sizes fall between two of the
    exchange's size classes), the same in every process."""
    import random

    rng = random.Random(seed * 10_000 + sender * 100 + dest)
    if rng.random() < 0.3:
        return None
    return rng.randbytes(rng.choice([0, 1, 7, rng.randrange(100, 5000),
                                     rng.randrange(5000, 300_000)]))


def exchanges(rank: int) -> list[str]:
    """``Comm.exchange`` of seeded random messages between every pair of ranks (to
    itself too): what each rank received that differs from what was sent to it."""
    from elastor_mcore.checkpoint import comm

    ranks = comm.Comm()
    wrong = []
    for seed in EXCHANGE_SEEDS:
        outgoing = {dest: m for dest in range(4)
                    if (m := exchange_message(seed, rank, dest)) is not None}
        received = ranks.exchange(outgoing, "the exchange test")
        expected = {sender: m for sender in range(4)
                    if (m := exchange_message(seed, sender, rank)) is not None}
        if received != expected:
            wrong.append(f"seed {seed}: from {sorted(received)}, expected {sorted(expected)}"
                         f" or other bytes")
    return wrong


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--root", default=None,
                        help="where the checkpoints go (default: --out; or an s3:// URL)")
    parser.add_argument("--no-subgroup", action="store_true",
                        help="skip the sub-group save (its uneven 3-way split makes "
                             "hundreds of tiny files: slow on a local S3 server)")
    args = parser.parse_args()
    out = Path(args.out)
    root = args.root or str(out)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from elastor_mcore import checkpoint as ck
    from elastor_mcore.checkpoint import reader

    policy = ck.ChunkPolicy(chunk_bytes=2 * 1024, file_bytes=8 * 1024)
    shards = save_boxes(rank)
    held = [(s.key, s.global_offset, tuple(s.data.shape)) for s in shards]
    saved = ck.save(f"{root}/world", 3, shards, {"layout": {"tp": 4}}, chunking=policy)

    report = {"rank": rank, "exchange": exchanges(rank)}
    real_page_cache = reader.page_cache_id
    # On object storage there is no page cache to share: the second pass would repeat
    # the first.
    passes = ["one host"] if root.startswith("s3://") else ["one host", "a host per rank"]
    for hosts in passes:
        if hosts == "a host per rank":  # as if each rank ran on its own machine
            reader.page_cache_id = lambda: f"host {rank}"
        for how in ("halves", "uneven", "whole"):
            targets = load_boxes(rank, how)
            before = ck.storage_bytes_read()
            ck.load(f"{root}/world", targets)
            report.setdefault(hosts, {})[how] = dict(
                mismatches=mismatches(targets),
                bytes_read=ck.storage_bytes_read() - before,
                bytes_needed=sum(t.data.numel() * t.data.element_size() for t in targets),
                tensor_bytes=sum(truth(k).numel() * truth(k).element_size() for k in TENSORS))
    reader.page_cache_id = real_page_cache
    if not root.startswith("s3://"):
        report["classes"] = class_loads(root, rank)
        report["disjoint_save"] = disjoint_saves(root, rank, policy)
        report["mixed"] = mixed_saves(root, rank, policy)
        report["class_saves"] = class_saves(root, rank, policy)

    if args.no_subgroup:
        write_world_result(out, report, saved.plan, held)
        dist.destroy_process_group()
        return
    # A sub-group that leaves rank 0 idle: it neither calls save nor blocks it.
    holders = dist.new_group([1, 2, 3])
    if rank != 0:
        mine = [piece(k, d, *split_bounds(s[d], 3)[rank - 1]) if d is not None
                else piece(k, None, 0, 0) for k, (s, _, d) in TENSORS.items()]
        ck.save(f"{root}/sub", 4, mine, {}, group=holders)
    dist.barrier()
    targets = load_boxes(rank, "halves")
    ck.load(f"{root}/sub", targets)
    report["subgroup"] = dict(mismatches=mismatches(targets),
                              writers=ck.open(f"{root}/sub").manifest.writers)

    write_world_result(out, report, saved.plan, held)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
