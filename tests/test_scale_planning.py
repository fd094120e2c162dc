"""Per-tensor planning (each tensor planned by its owner from its holders' shards; see
``checkpoint/plan.py``) against whole-job references, on seeded random layouts of
the tiny recipe with permuted, non-contiguous ranks and idle ranks.

The message passing of ``writer.plan_save`` and ``reader.plan_load`` is replayed in
one process: every rank's local plan routed to the owners, each owner's plan, each
rank's part. The references know nothing of owners:

* saves: per element, the ranks whose shards cover it (bit masks, as
  ``test_geometry``): every element is written exactly once, by one of those ranks,
  in a unit whose holders are exactly them; each tensor's entry is the one the whole
  job's shard boundaries give; each rank's plan holds exactly the units it writes;
  the coordinator knows every entry and every writer;
* loads: each rank's pieces are exactly the cells of the whole job's common
  refinement (``geometry.common_refinement`` over every rank's targets) that it holds;
  each cell has one reader among its holders, every holder agrees on it (or reads
  itself from the same page cache), and the reader sends it to exactly the holders on
  other hosts.

Seeds are in the test ids; ``layout_shard_infos`` gives each rank's shards.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import pickle
import random

import numpy as np
import pytest
import torch

from elastor_mcore.checkpoint import comm
from elastor_mcore.checkpoint.format import ChunkPolicy, choose_entry
from elastor_mcore.checkpoint.format import CheckpointError
from elastor_mcore.checkpoint.plan import (
    NO_REPLICAS, LocalPlan, Replicas, build_plan, held_bytes, plan_owned, route)
from elastor_mcore.checkpoint.plan import LocalShard
from elastor_mcore.checkpoint.reader import (
    ClassPeers, LoadRequest, SharedReads, class_pieces, open_checkpoint, peer_names, peers_of,
    plan_reads, read_boxes, relay_block, replies, to_relays)
from elastor_mcore.checkpoint.writer import save
from elastor_mcore.config.recipe import load_recipe
from elastor_mcore.geometry import Box, boundaries, common_refinement, local_view
from elastor_mcore.parallel.layout import layout_from_dict
from elastor_mcore.parallel.shards import layout_shard_infos, replica_classes

RECIPE = load_recipe("recipes/tiny-llama.yaml")
MAX_RANKS = 20
SEEDS = range(16)


def random_layout(seed: int, copies: int = 1, max_ranks: int = MAX_RANKS, lone: int = 0):
    """1-4 pipeline shapes (1-3 with ``copies``) of 1-3 stages, TP in {1, 2, 4}, each
    shape in 1 to ``copies`` pipelines (2 or more with ``copies``), and ``lone`` more
    shapes in one pipeline each, in a random order, on ranks drawn at random from
    ``range(max_ranks)`` (the rest idle)."""
    rng = random.Random(seed)
    layers = RECIPE.model.num_layers

    def draw_shape() -> list[tuple[int, int]]:
        stages = rng.randint(1, 3)
        cuts = sorted(rng.sample(range(1, layers), stages - 1))
        return [(rng.choice((1, 2, 4)), b - a) for a, b in zip([0, *cuts], [*cuts, layers])]

    while True:
        shapes = []
        for _ in range(rng.randint(1, 4 if copies == 1 else 3)):
            shapes += [draw_shape()] * (rng.randint(2, copies) if copies > 1 else 1)
        shapes += [draw_shape() for _ in range(lone)]
        used = sum(tp for shape in shapes for tp, _ in shape)
        if used <= max_ranks:
            break
    ranks = rng.sample(range(max_ranks), used)
    if copies > 1:
        shapes = rng.sample(shapes, len(shapes))
    pipelines = []
    for shape in shapes:
        stages = []
        for tp, n in shape:
            stages.append({"tp": tp, "layers": n, "ranks": ranks[:tp]})
            ranks = ranks[tp:]
        pipelines.append({"micro_batches": 1, "stages": stages})
    return layout_from_dict({"pipelines": pipelines})


def group_order(layout, seed: int) -> list[int]:
    """The group's ranks in a random order: its first is the coordinator."""
    ranks = list(layout.ranks)
    random.Random(seed + 1).shuffle(ranks)
    return ranks


def holder_masks(shape, boxes_by_rank) -> np.ndarray:
    mask = np.zeros(shape, dtype=np.int64)
    for rank, boxes in boxes_by_rank.items():
        for box in boxes:
            mask[box.slices()] |= np.int64(1) << rank
    return mask


def local_plans(infos, ranks, policy, replicas=NO_REPLICAS) -> dict[int, LocalPlan]:
    """Every rank's side of ``writer.plan_save``'s plan step (``plan.LocalPlan``)."""
    return {rank: LocalPlan.build(rank, infos[rank], ranks, policy, replicas)
            for rank in ranks}


def routed(local: dict[int, LocalPlan]) -> dict[int, dict]:
    """The first exchange of ``writer.plan_save``: ``outbox[owner][sender]``, the
    sender's request (only the members ``Replicas.sends`` names send their shards, to
    the owners of their columns)."""
    outbox: dict[int, dict] = {}
    for rank, plan in local.items():
        for owner, request in plan.requests.items():
            outbox.setdefault(owner, {})[rank] = request
    return outbox


def simulate_save(infos, ranks, policy, replicas=NO_REPLICAS):
    """``writer.plan_save`` for every rank at once: (every unit with its writer, each
    rank's plan). With ``replicas``, each owner plans one column of its tensors."""
    local = local_plans(infos, ranks, policy, replicas)
    outbox = routed(local)
    parts: dict[int, dict] = {}
    owned = {}
    for owner, inbox in outbox.items():
        told, owned[owner] = plan_owned(inbox, ranks, ranks.index(owner), policy, replicas,
                                        units=True)
        for rank, part in told.items():
            parts.setdefault(rank, {})[owner] = part
    plans = {r: local[r].merged(parts.get(r, {}).values(), owned.get(r, ()), replicas)
             for r in ranks}
    writers = {(u.key, u.box.offset): r for r, p in plans.items() for u in p.units}
    units = [dataclasses.replace(u, writer=writers.get((u.key, u.box.offset), -1))
             for p in plans.values() for u in p.owned]  # -1: nobody writes it
    return units, plans


@pytest.mark.parametrize("seed", SEEDS)
def test_save_plan_writes_every_element_once_by_a_holder(seed):
    layout = random_layout(seed)
    ranks = group_order(layout, seed)
    infos = {r: layout_shard_infos(RECIPE.model, layout, r) for r in ranks}
    policy = ChunkPolicy(split_sizes=tuple(RECIPE.model.valid_tp_sizes))
    units, plans = simulate_save(infos, ranks, policy)
    shapes = {i.key: i.global_shape for held in infos.values() for i in held}
    by_key: dict[str, list] = {}
    for unit in units:
        by_key.setdefault(unit.key, []).append(unit)
    assert set(by_key) == set(shapes)
    for key, shape in shapes.items():
        boxes = {r: [i.box for i in infos[r] if i.key == key] for r in ranks}
        mask = holder_masks(shape, boxes)
        written = np.zeros(shape, dtype=np.int64)
        for unit in by_key[key]:
            written[unit.box.slices()] += 1
            cover = np.unique(mask[unit.box.slices()])
            assert cover.tolist() == [sum(1 << h for h in unit.holders)], (seed, key, unit)
            assert unit.writer in unit.holders
        assert (written == 1).all(), (seed, key)
        expected = choose_entry(shape, "float32", boundaries(shape, [
            b for held in boxes.values() for b in held]), policy)
        assert plans[ranks[0]].entries[key] == expected, (seed, key)

    for rank in ranks:
        mine = sorted((u.key, u.box.offset) for u in plans[rank].units)
        assert mine == sorted((u.key, u.box.offset) for u in units if u.writer == rank)
        assert {u.key for u in plans[rank].units} <= set(plans[rank].entries)
    creators = [k for r in ranks for k in plans[r].creates]
    assert sorted(creators) == sorted(shapes)  # each array's metadata created once
    assert plans[ranks[0]].entries.keys() == shapes.keys()
    assert sorted((u.key, u.box.offset, u.writer) for u in units) == sorted(
        (u.key, u.box.offset, u.writer) for u in build_plan(infos, policy).units)


@pytest.mark.parametrize("seed", SEEDS)
def test_each_holder_set_is_balanced(seed):
    """The holders of a set choose its writers among themselves, largest unit first to
    the least loaded, each load weighted by what the member holds in all: within each
    set the weighted loads differ by at most its largest unit times the largest
    weight (the greedy's bound), whatever owner planned which tensor."""
    first, second = random_layout(seed), random_layout(seed + 500)  # replicas of each other
    infos = {r: layout_shard_infos(RECIPE.model, first, r) for r in first.ranks}
    infos.update({MAX_RANKS + r: layout_shard_infos(RECIPE.model, second, r)
                  for r in second.ranks})
    ranks = sorted(infos)
    random.Random(seed).shuffle(ranks)
    units, _ = simulate_save(infos, ranks, ChunkPolicy(chunk_bytes=4096, file_bytes=16384))
    weight = {r: held_bytes(held) for r, held in infos.items()}
    by_set: dict[tuple[int, ...], list] = {}
    for unit in units:
        by_set.setdefault(unit.holders, []).append(unit)
    shared = {h: u for h, u in by_set.items() if len(h) > 1}
    assert shared, "no replicated units: nothing tested"
    for holders, members in shared.items():
        load = dict.fromkeys(holders, 0)
        for unit in members:
            load[unit.writer] += unit.nbytes
        weighted = [load[r] * weight[r] for r in holders]
        bound = max(u.nbytes for u in members) * max(weight[r] for r in holders)
        assert max(weighted) - min(weighted) <= bound, (seed, holders, load)


def test_a_rank_holding_more_writes_less_of_what_it_shares():
    """Three pipelines of one stage and one of eight (rank 3 holds every layer, the
    others one layer each): one plan of the whole job would give rank 3 little to
    write; so do the holders' weighted choices, though each set is planned apart."""
    layout = layout_from_dict({"pipelines": [
        {"micro_batches": 1, "stages": [{"tp": 1, "layers": 1, "ranks": [4 + 8 * p + i]}
                                        for i in range(8)]} for p in range(3)] + [
        {"micro_batches": 1, "stages": [{"tp": 1, "layers": 8, "ranks": [3]}]}]})
    infos = {r: layout_shard_infos(RECIPE.model, layout, r) for r in layout.ranks}
    units, _ = simulate_save(infos, list(layout.ranks),
                             ChunkPolicy(chunk_bytes=1024, file_bytes=4096))
    load = dict.fromkeys(layout.ranks, 0)
    for unit in units:
        load[unit.writer] += unit.nbytes
    mean = sum(load.values()) / len(load)
    assert max(load.values()) <= 1.5 * mean, load


def test_files_are_the_whole_job_plans_files():
    """The units are the cells of the whole job's refinement cut by each tensor's file
    grid: the same files as planning everything in one place."""
    for seed in SEEDS:
        layout = random_layout(seed)
        ranks = group_order(layout, seed)
        infos = {r: layout_shard_infos(RECIPE.model, layout, r) for r in ranks}
        policy = ChunkPolicy(split_sizes=tuple(RECIPE.model.valid_tp_sizes))
        units, _ = simulate_save(infos, ranks, policy)
        whole = build_plan(infos, policy)
        got = sorted(((u.key, u.box.offset, u.holders), u.box) for u in units)
        expected = []
        for cell in common_refinement(infos):
            shard = whole.entries[cell.key].shard
            for lo in itertools.product(*(range(o, o + s, step) for o, s, step in
                                          zip(cell.box.offset, cell.box.shape, shard))):
                expected.append((cell.key, tuple(lo), cell.holders))
        assert [row for row, _ in got] == sorted(expected), seed
        assert sum(b.numel for _, b in got) == sum(
            math.prod(e.shape) for e in whole.entries.values())


@pytest.mark.parametrize("seed", SEEDS)
def test_load_pieces_are_the_whole_job_cells(seed):
    saved_by, loaded_by = random_layout(seed), random_layout(seed + 1000)
    del saved_by  # what a load plans depends on the targets only
    ranks = group_order(loaded_by, seed)
    infos = {r: layout_shard_infos(RECIPE.model, loaded_by, r) for r in ranks}
    cache = {r: f"host{r % 3}" for r in ranks}
    outbox: dict[int, dict] = {}
    for rank in ranks:
        for owner, mine in route(infos[rank], ranks).items():
            outbox.setdefault(owner, {})[rank] = LoadRequest(tuple(mine), cache[rank])
    pieces: dict[int, list] = {}
    for owner, inbox in outbox.items():
        for rank, part in plan_reads(inbox).items():
            pieces.setdefault(rank, []).extend(part)

    cells = common_refinement(infos)
    for rank in ranks:
        got = sorted((p.key, p.box.offset, p.box.shape) for p in pieces.get(rank, []))
        assert got == sorted((c.key, c.box.offset, c.box.shape)
                             for c in cells if rank in c.holders), (seed, rank)
    for cell in cells:
        held = {r: next(p for p in pieces[r] if (p.key, p.box) == (cell.key, cell.box))
                for r in cell.holders}
        away = {r for r, p in held.items() if p.reader != r}
        if not away:  # every holder reads it itself: one page cache holds them all
            assert len({cache[r] for r in cell.holders}) == 1, (seed, cell)
            assert sum(bool(p.send_to) for p in held.values()) == 0
            continue
        [reader] = {held[r].reader for r in away}
        assert reader in cell.holders and held[reader].reader == reader, (seed, cell)
        assert set(held[reader].send_to) == away
        assert all(cache[r] != cache[reader] for r in away)
        assert all(cache[r] == cache[reader] for r in set(cell.holders) - away)


def test_an_object_sent_to_every_rank_is_pickled_once():
    """A relay of a load's step directory sends it to every rank of its block: one
    pickle, however many ranks (``comm.pickled``), each message still its own."""
    step_dir, request = "/checkpoints/step_00000010", LoadRequest((), "node0")
    messages = comm.pickled({**dict.fromkeys(range(1, 1000), step_dir), 0: request})
    assert len({id(blob) for blob in messages.values()}) == 2
    assert pickle.loads(messages[999]) == step_dir and pickle.loads(messages[0]) == request


def replicated_layout(seed: int, lone: int = 0):
    """``random_layout`` with each shape in 2-4 pipelines on up to 40 ranks: replica
    classes of unequal sizes, stages of different pipelines holding the same layers;
    with ``lone``, that many pipelines of a shape of their own, whose ranks are mostly
    classes of one (``replica_classes``), as after a lost GPU."""
    return random_layout(seed, copies=4, max_ranks=40, lone=lone)


def claimed(layout, seed: int) -> Replicas:
    """The layout's replica classes, one of them sometimes left out (its ranks are
    then classes of their own)."""
    classes = list(replica_classes(layout))
    rng = random.Random(seed + 7)
    if rng.random() < 0.3:
        classes.pop(rng.randrange(len(classes)))
    return Replicas(tuple(classes))


LONE_SEEDS = range(24, 40)
"""Seeds of ``replicated_layout(seed, lone=1)``: each has classes of one beside classes
of two or more, so more than one column (``Replicas.columns``)."""
REPLICA_CASES = [pytest.param(seed, 0, id=f"seed{seed}") for seed in range(24)] + [
    pytest.param(seed, 1, id=f"seed{seed}-lone") for seed in LONE_SEEDS]


@pytest.mark.parametrize("seed,lone", REPLICA_CASES)
def test_replica_plan_is_the_plan_of_every_holder(seed, lone):
    """One member of each class per column sends its shards (a class of one to every
    column), owners plan per class, members find their own positions: the same files,
    holders and writers as the plan from every holder's shards (``build_plan``,
    positions by class then index), and every member's cells tile its shards."""
    layout = replicated_layout(seed, lone)
    ranks = group_order(layout, seed)
    infos = {r: layout_shard_infos(RECIPE.model, layout, r) for r in ranks}
    replicas = claimed(layout, seed)
    policy = ChunkPolicy(chunk_bytes=4096, file_bytes=16384)
    units, plans = simulate_save(infos, ranks, policy, replicas)
    whole = build_plan(infos, policy, replicas)
    assert replicas.columns >= 2, seed
    if lone:
        assert any(len(members) == 1 for members in replicas.classes), seed
    assert [(r, p.mismatch) for r, p in plans.items() if p.mismatch] == [], seed
    assert sorted((u.key, u.box.offset, u.holders, u.writer) for u in units) == sorted(
        (u.key, u.box.offset, u.holders, u.writer) for u in whole.units), seed
    for rank in ranks:
        assert sorted((u.key, u.box.offset) for u in plans[rank].units) == sorted(
            (u.key, u.box.offset) for u in whole.units if u.writer == rank), (seed, rank)
    assert sorted(k for p in plans.values() for k in p.creates) == sorted(whole.entries)
    assert plans[ranks[0]].entries == whole.entries, seed


@pytest.mark.parametrize("seed", LONE_SEEDS, ids=lambda seed: f"seed{seed}-lone")
def test_a_class_of_one_sends_about_as_many_copies_as_an_owner_tells_members(seed):
    """A rank alone in its class (a pipeline of a shape no other has) sends its shards
    to every column's owner, and an owner tells a column's share of each class: with
    classes of one, each is at most the square root of the smallest class of two or
    more (rounded up), where as many columns as that class had it send a copy to each
    and one column had an owner tell every member of every class. The plans are the
    whole job's: ``test_replica_plan_is_the_plan_of_every_holder``."""
    layout = replicated_layout(seed, lone=1)
    ranks = group_order(layout, seed)
    infos = {r: layout_shard_infos(RECIPE.model, layout, r) for r in ranks}
    replicas = Replicas(replica_classes(layout))
    root = math.ceil(math.sqrt(min(len(c) for c in replicas.classes if len(c) > 1)))
    lone = [r for r in ranks if len(replicas.of(r)[0]) == 1]
    assert lone and replicas.columns >= 2, seed
    policy = ChunkPolicy(chunk_bytes=4096, file_bytes=16384)
    outbox = routed(local_plans(infos, ranks, policy, replicas))
    copies = {(sender, i.key): 0 for sender in ranks for i in infos[sender]}
    for inbox in outbox.values():
        for sender, (_, mine, _, _) in inbox.items():
            for info in {i.key for i in mine}:
                copies[sender, info] += 1
    assert max(copies.values()) <= root, seed
    assert {copies[r, i.key] for r in lone for i in infos[r]} <= {replicas.columns}, seed
    for owner, inbox in outbox.items():
        told, _ = plan_owned(inbox, ranks, ranks.index(owner), policy, replicas)
        for members in replicas.classes:  # the coordinator hears every entry besides
            assert sum(r in told for r in members if r != ranks[0]) <= -(-len(members) // min(
                root, len(members))), (seed, owner, members)


@pytest.mark.parametrize("seed", range(12))
def test_a_false_replica_claim_fails_the_save(seed):
    """Two classes whose shards differ claimed as one: a member is told cells that do
    not tile its shards (or an owner finds a tensor uncovered), never a plan that
    writes a wrong file."""
    layout = next(layout for layout in map(replicated_layout, itertools.count(seed, 100))
                  if len(replica_classes(layout)) >= 2)
    ranks = group_order(layout, seed)
    infos = {r: layout_shard_infos(RECIPE.model, layout, r) for r in ranks}
    classes = list(replica_classes(layout))
    rng = random.Random(seed)
    a, b = rng.sample(range(len(classes)), 2)
    assert infos[classes[a][0]] != infos[classes[b][0]]
    wrong = [c for i, c in enumerate(classes) if i not in (a, b)]
    replicas = Replicas((*wrong, tuple(sorted(classes[a] + classes[b]))))
    try:
        _, plans = simulate_save(infos, ranks, ChunkPolicy(chunk_bytes=4096), replicas)
    except CheckpointError:
        return
    assert any(p.mismatch for p in plans.values()), seed


def saved_checkpoint(root, seed: int):
    """A checkpoint of random fp32 values saved in one process under ``random_layout``'s
    shard boundaries (the cells of its common refinement, each saved once), small
    files so that a class has many to share; its step directory."""
    layout = random_layout(seed)
    cells = common_refinement({r: layout_shard_infos(RECIPE.model, layout, r)
                               for r in layout.ranks})
    shapes = {i.key: i.global_shape for r in layout.ranks
              for i in layout_shard_infos(RECIPE.model, layout, r)}
    g = torch.Generator().manual_seed(seed)
    truth = {k: torch.randn(shape, generator=g) for k, shape in sorted(shapes.items())}
    shards = [LocalShard(c.key, shapes[c.key], c.box.offset,
                         local_view(truth[c.key], Box((0,) * len(shapes[c.key]),
                                                      shapes[c.key]), c.box).clone())
              for c in cells]
    save(root, 1, shards, chunking=ChunkPolicy(chunk_bytes=1024, file_bytes=8192))
    return root / "step_00000001"


def class_load(step, layout, ranks, replicas, cache):
    """Every rank's pieces as ``reader._load`` plans them with ``replicas``, each from
    ``class_pieces``: a class member's with its class's ``peer_names`` heard, a rank in
    no class's as a class of its own (its own targets, read by itself)."""
    infos = {r: layout_shard_infos(RECIPE.model, layout, r) for r in ranks}
    entries = open_checkpoint(step).manifest.tensors
    pieces: dict[int, list] = {}
    for rank in ranks:
        members = replicas.of(rank)[0]
        peers = (peers_of(rank, members, {m: peer_names(infos[m], cache[m]) for m in members})
                 if len(members) > 1 else ClassPeers(members, {rank: 0}))
        assert peers.mismatch is None
        pieces[rank] = class_pieces(rank, infos[rank], entries, peers)
    return infos, pieces


@pytest.mark.parametrize("seed", range(8))
def test_class_loads_are_bit_exact(seed, tmp_path):
    """Each class member reads its share of its class's cells and sends it to the
    members on other page caches; a rank in no class reads its own targets, sending
    and receiving nothing. Every piece a rank does not read, its reader reads and
    sends to it; every rank's targets then equal a single-process read of the
    checkpoint bit for bit; and within a class each piece is read from one page cache
    only (storage serves it once per class)."""
    step = saved_checkpoint(tmp_path, seed)
    layout = replicated_layout(seed + 500)
    ranks = group_order(layout, seed)
    replicas = claimed(layout, seed)
    cache = {r: f"host{r % 3}" for r in ranks}
    infos, pieces = class_load(step, layout, ranks, replicas, cache)
    manifest = open_checkpoint(step).manifest
    targets = {r: [LocalShard(i.key, i.global_shape, i.box.offset,
                              torch.full(i.box.shape, float("nan"))) for i in infos[r]]
               for r in ranks}
    shared = {r: SharedReads.build(r, targets[r], pieces.get(r, [])) for r in ranks}
    for rank in ranks:
        read_boxes(step, manifest, shared[rank].reads)
    for rank in ranks:
        for piece in shared[rank].pieces:
            if piece.reader == rank:
                continue
            sender = shared[piece.reader]
            source = next(p for p in sender.pieces if p.target.key == piece.target.key
                          and p.target.box == piece.target.box)
            assert source.reader == piece.reader, (seed, rank, piece.target.box)
            assert any(view is source.target.data for view in sender.sends[rank]), seed
            piece.target.data.copy_(source.target.data)
        for piece in shared[rank].pieces:
            for copy in piece.copies:
                copy.copy_(piece.target.data)
    reference = open_checkpoint(step)
    whole = {key: reference.read(key) for key in manifest.tensors}
    for rank in ranks:
        for target in targets[rank]:
            want = local_view(whole[target.key], Box((0,) * len(target.global_shape),
                                                     target.global_shape), target.box)
            assert torch.equal(target.data.view(torch.int32), want.view(torch.int32)), (
                seed, rank, target.key, target.box)
    for rank in ranks:
        if len(replicas.of(rank)[0]) < 2:  # a class of its own: reads all it holds
            assert all(p.reader == rank and not p.send_to for p in pieces[rank]), (seed, rank)
            assert not shared[rank].sends and all(p.reader == rank
                                                  for p in shared[rank].pieces), (seed, rank)
    for members in replicas.classes:
        if len(members) < 2:
            continue
        read_from: dict[tuple, set] = {}
        for rank in members:
            for target in shared[rank].reads:
                read_from.setdefault((target.key, target.box.offset, target.box.shape),
                                     set()).add(cache[rank])
        assert all(len(c) == 1 for c in read_from.values()), (seed, members)
        assert sorted(read_from) == sorted(
            (p.key, p.box.offset, p.box.shape) for p in pieces[members[0]]), seed
        apart = ClassPeers(members, {m: m for m in members})  # a host per member
        loads = dict.fromkeys(members, 0)
        sizes = []
        for p in class_pieces(members[0], infos[members[0]], manifest.tensors, apart):
            sizes.append(p.box.numel * 4)
            loads[p.reader] += sizes[-1]
        assert max(loads.values()) <= sum(sizes) / len(members) + max(sizes, default=0), (
            seed, members, loads)


def test_class_load_seeds_mix_classes_and_ranks_in_no_class():
    """``test_class_loads_are_bit_exact``'s seeds hold layouts with both classes of two
    or more and ranks in no class (a load of those once took a third step)."""
    mixed = [seed for seed, layout in ((s, replicated_layout(s + 500)) for s in range(8))
             if 0 < claimed(layout, seed).sharing < len(layout.ranks)]
    assert len(mixed) >= 2, mixed


@pytest.mark.parametrize("seed", range(12))
def test_a_false_replica_class_fails_the_load(seed):
    """Two classes whose targets differ claimed as one: a member hears another's
    targets named otherwise (``peers_of``), so its load fails before any read."""
    layout = next(layout for layout in map(replicated_layout, itertools.count(seed, 100))
                  if len(replica_classes(layout)) >= 2)
    infos = {r: layout_shard_infos(RECIPE.model, layout, r) for r in layout.ranks}
    classes = list(replica_classes(layout))
    a, b = random.Random(seed).sample(range(len(classes)), 2)
    members = tuple(sorted(classes[a] + classes[b]))
    heard = {m: peer_names(infos[m], "host0") for m in members}
    for rank in members:
        mismatch = peers_of(rank, members, heard).mismatch
        assert mismatch is not None and "hold other targets" in mismatch, (seed, rank)
        other = classes[b] if rank in classes[a] else classes[a]
        assert str(list(other[:8])[0]) in mismatch


@pytest.mark.parametrize("count", [1, 2, 3, 10, 17, 1000, 16016])
def test_the_step_directory_reaches_every_rank_through_relays(count):
    """The coordinator sends the step directory to the first rank of each block, which
    sends it to the rest of its block (``reader.plan_load``): every rank gets it, and
    no rank sends more than a block's worth of messages (about sqrt(count))."""
    ranks = random.Random(count).sample(range(3 * count), count)
    step_dir = "/checkpoints/step_00000007"
    first = to_relays({}, ranks, step_dir)
    block = relay_block(count)
    assert block * block >= count and (block - 1) ** 2 < count
    assert len(first) <= block
    second: dict[int, dict] = {}
    for position, rank in enumerate(ranks):
        known = first[rank] if rank in first else None
        assert (known is not None) == (position % block == 0), (count, position)
        out = replies({}, ranks, position, known)
        assert len(out) < block
        for dest, message in out.items():
            second.setdefault(dest, {})[rank] = message
    for position, rank in enumerate(ranks):
        if position % block:
            relay = ranks[position - position % block]
            assert second[rank][relay][1] == step_dir, (count, position)


@pytest.mark.parametrize("seed", range(4))
def test_the_digest_tells_a_file_written_twice_from_a_gap_the_count_misses(seed):
    """The ranks' ``written_digest``s of a whole-job plan sum to ``expected_digest`` of
    its entries; with one file written by two ranks and another by none (the count of
    files unchanged, what ranks that disagree on their writers do), or with both swapped
    between two such pairs, they do not."""
    from elastor_mcore.checkpoint.plan import DIGEST_BITS, WritePlan, expected_digest, written_digest

    layout = random_layout(seed)
    ranks = group_order(layout, seed)
    infos = {r: layout_shard_infos(RECIPE.model, layout, r) for r in ranks}
    plan = build_plan(infos, ChunkPolicy(chunk_bytes=4096, file_bytes=16384))

    def digest(units) -> int:
        by_writer: dict[int, list] = {}
        for unit in units:
            by_writer.setdefault(unit.writer, []).append(unit)
        return sum(written_digest(WritePlan(plan.entries, mine))
                   for mine in by_writer.values()) % 2 ** DIGEST_BITS

    assert digest(plan.units) == expected_digest(plan.entries)
    rng = random.Random(seed)
    for _ in range(20):
        a, b, c, d = rng.sample(range(len(plan.units)), 4)
        twice = [*plan.units, plan.units[a]]
        del twice[b]
        assert len(twice) == len(plan.units) and digest(twice) != expected_digest(plan.entries)
        # a file twice and one missing, and the reverse elsewhere: still caught
        swapped = [u for i, u in enumerate(plan.units) if i not in (b, d)] + [
            plan.units[a], plan.units[c]]
        assert digest(swapped) != expected_digest(plan.entries)


def test_a_ranks_own_plan_counts_the_bytes_it_writes():
    """``WritePlan.bytes_by_rank`` of the plan a rank merges (its units carry no
    holders) is its own written bytes: ``tools/bench_checkpoint.py`` reads it so, and
    raised ``KeyError`` on every rank since the plan became per tensor."""
    layout = random_layout(0)
    ranks = group_order(layout, 0)
    infos = {r: layout_shard_infos(RECIPE.model, layout, r) for r in ranks}
    _, plans = simulate_save(infos, ranks, ChunkPolicy(chunk_bytes=4096, file_bytes=16384))
    writers = [r for r, plan in plans.items() if plan.units]
    assert writers
    for rank in writers:
        assert plans[rank].bytes_by_rank() == {rank: sum(u.nbytes for u in plans[rank].units)}
