"""Checkpoint planning, gradient cells and the planner on simulated worlds of up to
16,384 GPUs: the project's real planning code, no processes, no data.

    PYTHONPATH=. python tools/bench_scale.py [--models llama3-8b,llama3-70b,llama3-405b]
        [--worlds 64,512,4096,16384] [--lost 1,8,64] [--samples 3]
        [--only uniform,save,load,grad,restore] [--no-replicas] [--zero1] [--megatron-lm]
        [--before] [--out FILE]
    PYTHONPATH=. python tools/bench_scale.py --table FILE...   # markdown tables
    PYTHONPATH=. python tools/bench_scale.py --table BEFORE AFTER --curve MODEL LOST
        [--kinds save,load,grad]
    PYTHONPATH=. python tools/bench_scale.py --planner-table FILE...

Each rank's state is what ``parallel.shards.layout_shard_infos`` derives from the
layout and the recipe's shapes (the fp32 main weights and AdamW's two moments of the
rank's ShardedTensors; ``tests/test_bench_scale.py`` checks it against real mcore
``sharded_state_dict()`` metadata); with ``--zero1`` the distributed optimizer's
state instead, each rank's own rows of them (``state_of``, checked against a real
``DistributedOptimizer``'s); with ``--megatron-lm`` what Megatron-LM's zarr saves
hold under Elastor's ZeRO-1 (``MegatronLMState``: bf16 weights replicated over the
replica classes, ZeRO-1's rows on their grid, ShardedObjects as named files), on the
failure layouts. Per model and world: the uniform layout Megatron
would use (``UNIFORM``), and the planner's layout after losing 1, 8 and 64 GPUs
scattered over the nodes. Per case:

* **save** under the uniform layout and under each failure layout: ``writer.plan_save``
  (the owners' plans, the holders' writers and metadata creators, each member's check
  of its cells) and the finish (the coordinator's manifest); with ``--zero1`` as the
  trainer saves ZeRO-1's state (``Replicas(disjoint=True, grid=...)``): each rank's
  own plan (``plan.plan_disjoint``), the entries to the coordinator, and how evenly
  the ranks own the state (``segment_balance``, ``owning_ranks``);
* **load** of the uniform layout's checkpoint under each failure layout: with the
  layout's replica classes (``parallel.shards.replica_classes``, as the trainer
  passes them to its saves and loads without ZeRO-1; built once per layout, its CPU
  reported apart as ``replicas_s``), ``Comm.announce``, each member's check of its
  class (``reader.class_peers``) and split of its class's reads
  (``reader.class_pieces``), a rank in no class reading its own targets; without them
  (``--no-replicas``), ``reader.plan_load`` (the owners' refinements and shared reads,
  the step directory through its relays); the save likewise with the classes (the
  owners hearing one member of each class per column) or without (one owner per
  tensor hearing from every holder);
* **grad cells**: the gradient-reduction cells and buckets (``runtime.grad_sync``):
  each rank's cells of its own tensors, derived from the layout (``parallel.holders``),
  the job's holder sets whose groups every rank creates, and the checks (an all-reduce
  of 16 bytes per holder set a rank is in, one job-wide flag);
* **planner**: ``planner.plan`` for the alive GPUs (H100-80GB profile).

Job-wide collectives go through ``SimComm``; each records the bytes every rank sends
and receives (pickled, as ``Comm.exchange`` and ``all_gather_object`` move them),
grouped into DCP's steps (a class's point-to-point messages, and the grad cells'
checks within holder sets, are added to a rank's bytes apart). Per-rank CPU is
``time.process_time`` of each rank's share of the work (pickling what it sends,
unpickling what it receives, planning), for every simulated rank of a save or load (a
load's pieces and ``SharedReads.build`` only on ``--samples`` ranks) and, for the grad
cells, on ``--samples`` ranks (each timed three times, the least kept). Nothing here
writes or reads storage.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import pickle
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from elastor_mcore.checkpoint import comm  # noqa: E402
from elastor_mcore.checkpoint import reader  # noqa: E402
from elastor_mcore.checkpoint.format import DTYPE_ITEMSIZE, Manifest  # noqa: E402
from elastor_mcore.checkpoint.plan import (  # noqa: E402
    NO_REPLICAS, LocalPlan, LocalShard, Replicas, merge_entries, plan_disjoint, plan_owned,
    plan_tensors, route)
from elastor_mcore.checkpoint.reader import LoadRequest  # noqa: E402
from elastor_mcore.config.recipe import Recipe, load_recipe  # noqa: E402
from elastor_mcore.geometry import ShardInfo, common_refinement  # noqa: E402
from elastor_mcore.parallel.layout import Layout, layout_from_dict  # noqa: E402
from elastor_mcore.parallel.holders import (  # noqa: E402
    LocalTensor, Placement, plan_rank, rank_cells)
from elastor_mcore.parallel.shards import (  # noqa: E402
    ADAM_STATE_PREFIXES, layout_shard_infos, replica_classes, stage_tensors)
from elastor_mcore.planner import PlannerError, load_hardware, plan  # noqa: E402
from elastor_mcore.runtime import reshard  # noqa: E402
from elastor_mcore.runtime.distributed_optimizer import file_cuts, rank_buckets  # noqa: E402
from elastor_mcore.runtime.memory_tier import Holding, replica_partners  # noqa: E402
from elastor_mcore.runtime.grad_sync import reduction_plan, spans_stages  # noqa: E402
from elastor_mcore.runtime.state import ADAM_MOMENTS, chunk_policy  # noqa: E402
from elastor_mcore.integrations.megatron_lm.zero_optimizer import (  # noqa: E402
    MAIN_PARAM, STATE_PREFIX)

GPUS_PER_NODE = 8
UNIFORM = {  # model: (TP, layers per stage); DP fills the world
    "llama3-8b": (2, [32]),             # the recipe's default layout, dp16-tp2-pp1
    "llama3-70b": (4, [20] * 4),        # the recipe's default layout, dp16-tp4-pp4
    # Meta's 405B pre-training: TP 8, PP 16, one layer fewer on the first and last
    # stages ("The Llama 3 Herd of Models", Table 4 and section 3.3.2).
    "llama3-405b": (8, [7] + [8] * 14 + [7]),
}
HARDWARE = REPO / "recipes/hardware/h100-80gb.yaml"


# --------------------------------------------------------------------------- comm


@dataclass
class Collective:
    step: str
    """The job-wide step this call belongs to (DCP counts its steps: a plan's gather
    and scatter are one ``reduce_scatter``, a finish's gather and broadcast one
    ``all_reduce``)."""
    call: str
    max_sent: int
    max_received: int


@dataclass
class SimComm:
    """Moves pickled messages between simulated ranks and counts what every rank of
    the job sends and receives in each call (all of them job-wide)."""

    ranks: list[int]
    log: list[Collective] = field(default_factory=list)
    sent: dict[int, int] = field(default_factory=dict)
    received: dict[int, int] = field(default_factory=dict)

    def _count(self, step: str, call: str, sent: dict[int, int],
               received: dict[int, int]) -> None:
        self.point_to_point(sent, received)
        self.log.append(Collective(step, call, max(sent.values(), default=0),
                                   max(received.values(), default=0)))

    def all_gather_sizes(self, step: str, sizes: dict[int, int]) -> None:
        """An ``all_gather_object`` of objects of these pickled sizes: each rank
        receives every other rank's object (and, in a ring, forwards as many bytes)."""
        total = sum(sizes.values())
        others = {r: total - sizes[r] for r in self.ranks}
        self._count(step, "all_gather_object", others, others)

    def all_gather_small(self, step: str, value: Any) -> None:
        """An ``all_gather_object`` where every rank contributes ``value``."""
        self.all_gather_sizes(step, dict.fromkeys(self.ranks, len(pickle.dumps(value))))

    def all_reduce(self, step: str, nbytes: int) -> None:
        """An ``all_reduce`` of ``nbytes`` per rank (a ring sends and receives about
        twice that)."""
        each = dict.fromkeys(self.ranks, 2 * nbytes)
        self._count(step, "all_reduce", each, each)

    def broadcast(self, step: str, value: Any) -> None:
        """``broadcast_object_list`` from the coordinator (a tree: each rank receives
        the object once and forwards it at most twice)."""
        n = len(pickle.dumps(value))
        self._count(step, "broadcast_object_list", dict.fromkeys(self.ranks, 2 * n),
                    dict.fromkeys(self.ranks, n))

    def exchange(self, step: str, outbox: dict[int, dict[int, bytes]]) -> None:
        """``comm.Comm.exchange``: ``outbox[dest][sender]`` pickled messages (a rank's
        message to itself is not sent). Two ``all_to_all_single`` calls: the sizes (a
        byte to every rank, ``comm.size_class``), then the messages, each padded to its
        class."""
        n = len(self.ranks)
        sizes = dict.fromkeys(self.ranks, n - 1)
        self._count(step, "all_to_all_single (sizes)", sizes, sizes)
        sent = dict.fromkeys(self.ranks, 0)
        received = dict.fromkeys(self.ranks, 0)
        for dest, inbox in outbox.items():
            for sender, blob in inbox.items():
                if sender != dest:
                    padded = comm.SIZE_CLASSES[comm.size_class(len(blob))]
                    sent[sender] += padded
                    received[dest] += padded
        self._count(step, "all_to_all_single (messages)", sent, received)

    def gather(self, step: str, coordinator: int, sizes: dict[int, int]) -> None:
        """``comm.Comm.gather``: an ``all_reduce`` of an error count and a bitmap of the
        senders (8 bytes per 64 ranks), then each sender's size (8 bytes) and message
        (``sizes``: pickled bytes, by sender) to the coordinator, point to point
        (in the senders' and the coordinator's bytes, not a job-wide call)."""
        nbytes = 8 * (1 + -(-len(self.ranks) // 64))
        each = dict.fromkeys(self.ranks, 2 * nbytes)
        self._count(step, "all_reduce (senders)", each, each)
        sent = {r: 8 + n for r, n in sizes.items() if r != coordinator}
        self.point_to_point(sent, {coordinator: sum(sent.values())})

    def point_to_point(self, sent: dict[int, int], received: dict[int, int]) -> None:
        """Messages between ranks that know each other (``Comm.swap``): counted in
        every rank's bytes, not as a job-wide call."""
        for rank, n in sent.items():
            self.sent[rank] = self.sent.get(rank, 0) + n
        for rank, n in received.items():
            self.received[rank] = self.received.get(rank, 0) + n

    def summary(self) -> dict[str, Any]:
        """The steps and calls, each call's most bytes a rank sent and received
        (``call_bytes``: which part of a plan dominates), and the rank that exchanged
        the most (``largest_rank``)."""
        exchanged = {r: self.sent.get(r, 0) + self.received.get(r, 0) for r in self.ranks}
        largest = max(exchanged, key=exchanged.get, default=None)
        return {"job_wide_steps": len({c.step for c in self.log}),
                "job_wide_calls": len(self.log),
                "calls": [f"{c.step}: {c.call}" for c in self.log],
                "call_bytes": [[f"{c.step}: {c.call}", c.max_sent, c.max_received]
                               for c in self.log],
                "max_sent_bytes": max(self.sent.values(), default=0),
                "max_received_bytes": max(self.received.values(), default=0),
                "max_exchanged_bytes": exchanged.get(largest, 0), "largest_rank": largest,
                "largest_rank_sent_bytes": self.sent.get(largest, 0)}


def cpu(fn: Callable[[], Any]) -> tuple[float, Any]:
    """``fn``'s result and CPU seconds. The cyclic garbage collector is off (``main``):
    a save or load pauses it on a real rank (``checkpoint.gc_pause``), and here a
    collection would walk every simulated rank's objects at once."""
    start = time.process_time()
    out = fn()
    return time.process_time() - start, out


def sample_ranks(ranks: list[int], n: int) -> list[int]:
    """``n`` ranks spread over the job, the first and the last included."""
    if n >= len(ranks):
        return list(ranks)
    return sorted({ranks[round(i * (len(ranks) - 1) / max(1, n - 1))] for i in range(n)})


# --------------------------------------------------------------------------- layouts


def scaled_recipe(recipe: Recipe, dp: int, stages: int) -> Recipe:
    """The recipe with a global batch of at least one micro-batch per stage of each
    pipeline (1F1B's least; the planner refuses a pipeline with fewer)."""
    micro = recipe.training.total_micro_batches
    if micro % dp == 0 and micro // dp >= stages:
        return recipe
    batch = -(-max(micro, dp * stages) // dp) * dp * recipe.training.micro_batch_size
    return dataclasses.replace(recipe, training=dataclasses.replace(
        recipe.training, global_batch_size=batch))


def uniform(recipe: Recipe, world: int) -> tuple[Recipe, Layout] | None:
    tp, stages = UNIFORM[recipe.name]
    per_pipeline = tp * len(stages)
    if world % per_pipeline:
        return None
    dp = world // per_pipeline
    recipe = scaled_recipe(recipe, dp, len(stages))
    micro = recipe.training.total_micro_batches // dp
    # mcore's rank order: TP fastest, then DP, then PP
    layout = layout_from_dict({"pipelines": [
        {"micro_batches": micro,
         "stages": [{"tp": tp, "layers": layers,
                     "ranks": [t + tp * d + tp * dp * s for t in range(tp)]}
                    for s, layers in enumerate(stages)]}
        for d in range(dp)]})
    layout.validate(recipe)
    return recipe, layout


def lost_gpus(world: int, lost: int) -> list[int]:
    """``lost`` GPUs on as many different nodes, spread over the job."""
    nodes = world // GPUS_PER_NODE
    return sorted((i * nodes // lost) * GPUS_PER_NODE + i % GPUS_PER_NODE
                  for i in range(lost))


# --------------------------------------------------------------------------- cases


State = Callable[[int], list[ShardInfo]]
"""A rank's checkpointed state (its ShardInfos), by rank."""


def state_of(recipe: Recipe, layout: Layout, zero1: bool = False,
             megatron_lm: bool = False) -> State:
    """Each rank's training state as ``runtime.state.state_shards`` checkpoints it:
    the fp32 main weights and AdamW's two moments of its stage's ShardedTensors
    (``layout_shard_infos``, replicated over data parallelism); under ZeRO-1 only the
    rows of them its ``ShardPlan`` owns (``Zero1State``); what Megatron-LM's zarr saves
    hold (``MegatronLMState``)."""
    if megatron_lm:
        return MegatronLMState(recipe, layout)
    if not zero1:
        return functools.partial(layout_shard_infos, recipe.model, layout)
    return Zero1State(recipe, layout)


class Zero1State:
    """Each rank's ZeRO-1 state: the rows its ``ShardPlan`` owns
    (``distributed_optimizer.rank_buckets`` of its cells, ``parallel.holders``: every
    element of the job held by one rank), and the file grid of its tensors that its
    saves pass (``Replicas.grid``, ``runtime.state.state_replicas``); derived once per
    replica class, whose members hold the same cells and cut the same buckets."""

    def __init__(self, recipe: Recipe, layout: Layout,
                 prefixes: tuple[str, ...] = ADAM_STATE_PREFIXES) -> None:
        self.recipe, self.layout, self.prefixes = recipe, layout, prefixes
        self.placement, self.policy = Placement(layout), chunk_policy(recipe)
        self.first = {r: members[0] for members in replica_classes(layout) for r in members}

    @functools.cache
    def _lead(self, lead: int) -> tuple[dict, list, dict]:
        tensors = model_tensors(self.recipe, self.layout, lead)
        cells, sets = rank_cells(self.placement, lead, tensors, False)
        shapes = {t.info.key: t.info.global_shape for t in tensors}
        grid = {prefix + key: cuts for key, cuts in file_cuts(cells, shapes).items()
                for prefix in self.prefixes}
        return shapes, rank_buckets(cells, shapes, lambda h: sets[h].stages, lead,
                                    self.policy), grid

    @functools.cache
    def __call__(self, rank: int) -> list[ShardInfo]:
        if rank not in self.first:
            return []
        shapes, mine, _ = self._lead(self.first[rank])
        return sorted((ShardInfo(prefix + f.cell.key, shapes[f.cell.key], f.box, "float32")
                       for bucket in mine for f in bucket.fragments(rank)
                       for prefix in self.prefixes), key=lambda info: info.key)

    def grid(self, rank: int) -> dict:
        """The file grid of ``rank``'s tensors."""
        return self._lead(self.first[rank])[2] if rank in self.first else {}

    def replicas(self, rank: int) -> Replicas:
        """What ``rank`` passes its saves and loads."""
        return Replicas(disjoint=True, grid=self.grid(rank))


MEGATRON_ZERO1_PREFIXES = tuple(f"{STATE_PREFIX}.{name}." for name in (MAIN_PARAM, *ADAM_MOMENTS))
"""The keys of Elastor's ZeRO-1 state in Megatron-LM's checkpoints
(``ZeroMegatronOptimizer.sharded_state_dict``, ``zero_optimizer.checkpoint_grid``)."""


class MegatronLMState:
    """What Megatron-LM's zarr saves hold on a heterogeneous layout under
    ``--use-distributed-optimizer`` (Elastor's ZeRO-1 behind Megatron's optimizer):
    each rank's bf16 model weights, the same on every member of its replica class,
    and its own rows of the fp32 main weights and moments under Megatron's keys, on
    their file grid; with the replicas ``zarr_format.state_replicas`` passes (the
    classes, and the grid of the rank's own state) and the named files a rank offers
    (``megatron_dir``): each class's first member its stage's ``rng_state``
    ShardedObject, rank 0 also ``common.pt``."""

    def __init__(self, recipe: Recipe, layout: Layout) -> None:
        self.model, self.layout = recipe.model, layout
        self.zero1 = Zero1State(recipe, layout, MEGATRON_ZERO1_PREFIXES)
        self.classes = replica_classes(layout)

    @functools.cache
    def _weights(self, lead: int) -> list[ShardInfo]:
        return layout_shard_infos(self.model, self.layout, lead, "bfloat16", ("",))

    @functools.cache
    def __call__(self, rank: int) -> list[ShardInfo]:
        if rank not in self.zero1.first:
            return []
        return sorted([*self._weights(self.zero1.first[rank]), *self.zero1(rank)],
                      key=lambda info: info.key)

    @functools.cache
    def _replicas(self, lead: int) -> Replicas:
        return Replicas(self.classes, grid=self.zero1.grid(lead))

    def replicas(self, rank: int) -> Replicas:
        """What ``rank`` passes its saves and loads (the members of a class hold the
        same cells, so the same grid)."""
        return self._replicas(self.zero1.first.get(rank, rank))

    def files(self, rank: int) -> list[str]:
        position = self.layout.position(rank)
        if position is None or self.zero1.first[rank] != rank:
            return ["common.pt"] if rank == self.layout.ranks[0] else []
        stage = self.layout.pipelines[position.pipeline].stages[position.stage]
        stages = len(self.layout.pipelines[position.pipeline].stages)
        name = (f"megatron_objects/rng_state/shard_{position.stage}.{position.tp_rank}_"
                f"{stages}.{stage.tp}.pt")
        return [name, "common.pt"] if rank == self.layout.ranks[0] else [name]


def page_cache(rank: int) -> str:
    return f"node{rank // GPUS_PER_NODE}"


RETIME_S = 0.003
"""A rank's phase that took longer is timed twice more (the phases are pure) and its
least time kept: on this shared machine the slowest of thousands of ranks was
otherwise a crowded core's hiccup (two runs of a 4,096-rank load: the slowest rank
0.009 s and 0.024 s, the median 0.005 s and 0.004 s)."""


class RankClock:
    """CPU seconds per simulated rank, summed over the phases each rank runs."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}

    def run(self, rank: int, fn: Callable[[], Any]) -> Any:
        seconds, out = cpu(fn)
        if seconds > RETIME_S:
            seconds = min(seconds, *(cpu(fn)[0] for _ in range(2)))
        self.seconds[rank] = self.seconds.get(rank, 0.0) + seconds
        return out

    def summary(self, sampled: dict[int, float] | None = None) -> dict[str, Any]:
        """The slowest rank (and which), adding ``sampled``'s slowest where a phase ran
        on the sampled ranks only."""
        rank = max(self.seconds, key=self.seconds.get, default=None)
        extra = max(sampled.values()) if sampled else 0.0
        values = list(self.seconds.values()) or [0.0]
        p99 = statistics.quantiles(values, n=100)[98] if len(values) > 1 else values[0]
        return {"plan_cpu_s_max": self.seconds.get(rank, 0.0) + extra, "slowest_rank": rank,
                "plan_cpu_s_median": statistics.median(values) + extra,
                "plan_cpu_s_p99": p99 + extra, "sampled_phase_s_max": extra}


def exchange_to_owners(layout: Layout, state: State, clock: RankClock,
                       message: Callable[[int, list], dict[int, Any]]
                       ) -> dict[int, dict[int, bytes]]:
    """Every rank's local plan (``message``: its shard descriptions, by destination),
    pickled as ``Comm.exchange`` sends it: ``outbox[dest][sender]``."""
    outbox: dict[int, dict[int, bytes]] = {}
    for rank in layout.ranks:
        infos = state(rank)
        routed = clock.run(rank, lambda: comm.pickled(message(rank, infos)))
        for dest, blob in routed.items():
            outbox.setdefault(dest, {})[rank] = blob
    return outbox


def receive(clock: RankClock, rank: int, inbox: dict[int, bytes]) -> dict[int, Any]:
    return clock.run(rank, lambda: {s: pickle.loads(b) for s, b in sorted(inbox.items())})


RankReplicas = Callable[[int], Replicas]
"""What each rank passes its saves and loads (the same classes on every rank; a
rank's grid, of mixed state, its own tensors')."""


def per_rank(replicas: Replicas | RankReplicas) -> RankReplicas:
    return replicas if callable(replicas) else (lambda rank: replicas)


def save_case(recipe: Recipe, layout: Layout, state: State,
              replicas: Replicas | RankReplicas = NO_REPLICAS,
              files: Callable[[int], list[str]] = lambda rank: []) -> dict[str, Any]:
    """``writer._write_checkpoint``'s planning, step by step as the real code runs it
    (``writer.plan_save``: each rank's ``plan.LocalPlan``, the owners' ``plan_owned``,
    each rank's merge; then the finish), every rank simulated, each offering its
    named ``files``. The writer balance is the largest writer's bytes over the mean
    writer's."""
    ranks = list(layout.ranks)
    policy, of = chunk_policy(recipe), per_rank(replicas)
    sim, clock = SimComm(ranks), RankClock()
    local: dict[int, LocalPlan] = {}

    def requests(rank: int, infos: list) -> dict:
        local[rank] = LocalPlan.build(rank, infos, ranks, policy, of(rank), files(rank))
        return local[rank].requests
    outbox = exchange_to_owners(layout, state, clock, requests)
    sim.exchange("plan", outbox)
    replies: dict[int, dict[int, bytes]] = {}
    entries: dict[str, Any] = {}
    for owner, inbox in outbox.items():
        received = receive(clock, owner, inbox)
        parts, _ = clock.run(owner, lambda: plan_owned(
            received, ranks, ranks.index(owner), policy, of(owner)))
        for rank, blob in clock.run(owner, lambda: comm.pickled(parts)).items():
            replies.setdefault(rank, {})[owner] = blob
        for part in parts.values():
            entries.update(part.entries)
    del outbox
    sim.exchange("plan", replies)
    written, named, units = [], [], 0
    for rank in ranks:
        parts = receive(clock, rank, replies.pop(rank, {}))
        plan = clock.run(rank, lambda: local[rank].merged(parts.values(), replicas=of(rank)))
        del local[rank]
        assert plan.mismatch is None, (rank, plan.mismatch)
        written.append(sum(u.nbytes for u in plan.units))
        named += plan.files
        units += len(plan.units)
    assert units == sum(e.num_files for e in entries.values()), "a file written twice or never"
    sim.all_reduce("finish", 24)
    manifest_s, text = cpu(lambda: Manifest.build(
        0, entries, sum(1 for n in written if n), {"layout": layout.to_dict()}).to_json())
    sim.broadcast("finish", None)
    offered = {name for rank in ranks for name in files(rank)}
    assert sorted(named) == sorted(offered), "a named file written twice or never"
    writers_bytes = [n for n in written if n]
    summary, replicas = sim.summary(), of(ranks[0])
    return {"ranks": len(ranks), **clock.summary(), **summary,
            "columns": replicas.columns,
            "classes_of_one": sum(len(replicas.of(r)[0]) < 2 for r in ranks),
            "largest_rank_class": len(replicas.of(summary["largest_rank"])[0]),
            "coordinator_manifest_s": manifest_s, "manifest_bytes": len(text),
            "tensors": len(entries),
            "files": units + len(entries) + len(named) + 2, "named_files": len(named),
            "writer_balance": max(writers_bytes) / statistics.mean(writers_bytes),
            "bytes": sum(e.nbytes for e in entries.values())}


def disjoint_save_case(recipe: Recipe, layout: Layout, state: Zero1State) -> dict[str, Any]:
    """``writer.plan_save`` of disjoint state with its grid (ZeRO-1, as the trainer
    saves it), then the finish, every rank simulated: each rank's own plan
    (``plan.plan_disjoint``) and its entries to the coordinator (``Comm.gather``),
    which merges them. ``segment_balance``: the most elements a rank owns over the
    mean."""
    ranks = list(layout.ranks)
    policy, coordinator = chunk_policy(recipe), layout.ranks[0]
    sim, clock = SimComm(ranks), RankClock()
    inbox: dict[int, bytes] = {}
    own: dict[str, Any] = {}
    files, wrote, owned, written = 0, 0, [], []
    for rank in ranks:
        infos, grid = state(rank), state.replicas(rank).grid

        def local():
            plan = plan_disjoint(rank, infos, policy, grid)
            created = plan.created_entries()
            sends = created and rank != coordinator
            return plan, created, pickle.dumps(created) if sends else None
        plan, created, blob = clock.run(rank, local)
        assert plan.mismatch is None, (rank, plan.mismatch)
        if blob is not None:
            inbox[rank] = blob
        elif rank == coordinator:
            own = created
        files += len(plan.units)
        wrote += bool(plan.units)
        owned.append(sum(i.box.numel for i in infos))
        written.append(sum(u.nbytes for u in plan.units))
    sim.gather("plan", coordinator, {r: len(b) for r, b in inbox.items()})
    received = receive(clock, coordinator, inbox)
    entries = clock.run(coordinator, lambda: merge_entries([own, *received.values()]))
    sim.all_reduce("finish", 24)
    manifest_s, text = cpu(lambda: Manifest.build(
        0, entries, wrote, {"layout": layout.to_dict()}).to_json())
    sim.broadcast("finish", None)
    assert files == sum(e.num_files for e in entries.values()), "a file written twice or never"
    writers_bytes = [n for n in written if n]
    return {"ranks": len(ranks), **clock.summary(), **sim.summary(),
            "columns": 1, "coordinator_manifest_s": manifest_s, "manifest_bytes": len(text),
            "tensors": len(entries), "files": files + len(entries) + 2,
            "writer_balance": max(writers_bytes) / statistics.mean(writers_bytes),
            "segment_balance": max(owned) / statistics.mean(owned),
            "segment_max_bytes": 4 * max(owned),
            "segment_mean_bytes": 4 * statistics.mean(owned),
            "owning_ranks": sum(1 for n in owned if n),
            "bytes": sum(e.nbytes for e in entries.values())}


def load_case(layout: Layout, state: State, samples: int, entries: dict[str, Any],
              replicas: Replicas | RankReplicas = NO_REPLICAS) -> dict[str, Any]:
    """``reader._load``'s planning, then the agreement after the reads, every rank
    simulated; the pieces (``reader.class_pieces`` of a class member, from the saved
    checkpoint's ``entries``) and ``SharedReads.build`` (views into the targets: meta
    tensors here) on ``samples`` ranks. With replica classes: ``Comm.announce`` and
    each member's ``reader.class_peers`` (point to point within its class, counted in
    the bytes but not as a job-wide call), a rank in no class being a class of its own;
    with disjoint state (ZeRO-1) the announcement alone, each rank reading its own
    targets, as of the grid's tensors of mixed state (``reader.class_load_pieces``);
    without: ``reader.plan_load``."""
    ranks = list(layout.ranks)
    coordinator = ranks[0]
    sim, clock = SimComm(ranks), RankClock()
    step_dir = "/checkpoints/step_00000000"
    infos_of, of = state, per_rank(replicas)
    replicas = of(coordinator)  # the classes, the same on every rank
    classes = bool(replicas.sharing) or replicas.disjoint
    peers: dict[int, reader.ClassPeers] = {}
    replies: dict[int, dict[int, bytes]] = {}
    if classes:
        sim.all_reduce("plan", comm.ANNOUNCE_BYTES + 32)
        names = {}
        for rank in (r for r in ranks if len(replicas.of(r)[0]) > 1):
            infos = infos_of(rank)
            names[rank] = clock.run(rank, lambda: reader.peer_names(
                of(rank).split(infos)[0], page_cache(rank)))
        each = {r: 16 * (len(replicas.of(r)[0]) - 1) for r in names}
        sim.point_to_point(each, each)
        for rank in ranks:
            members = replicas.of(rank)[0]
            if len(members) < 2:  # a class of its own: reads its own targets
                peers[rank] = reader.ClassPeers(members, {rank: 0})
                continue
            peers[rank] = clock.run(rank, lambda: reader.peers_of(
                rank, members, {m: names[m] for m in members}))
            assert peers[rank].mismatch is None, (rank, peers[rank].mismatch)
    else:
        def requests(rank: int, infos: list) -> dict[int, LoadRequest | str]:
            out: dict[int, LoadRequest | str] = {
                owner: LoadRequest(tuple(mine), page_cache(rank))
                for owner, mine in route(infos, ranks).items()}
            return reader.to_relays(out, ranks, step_dir) if rank == coordinator else out

        outbox = exchange_to_owners(layout, state, clock, requests)
        sim.exchange("plan", outbox)
        for owner, inbox in outbox.items():
            received = receive(clock, owner, inbox)
            pieces = clock.run(owner, lambda: comm.pickled(reader.replies(reader.plan_reads(
                {r: q for r, q in received.items() if isinstance(q, LoadRequest)}), ranks,
                ranks.index(owner), step_dir)))
            for rank, blob in pieces.items():
                replies.setdefault(rank, {})[owner] = blob
        del outbox
        sim.exchange("plan", replies)
    built, read_bytes = {}, []
    chosen = set(sample_ranks(ranks, samples))
    for rank in ranks:
        parts = {} if classes else receive(clock, rank, replies.get(rank, {}))
        if rank not in chosen:
            continue
        infos = infos_of(rank)
        targets = [LocalShard(i.key, i.global_shape, i.box.offset,
                              torch.empty(i.box.shape, device="meta")) for i in infos]
        seconds, shared = cpu(lambda: reader.SharedReads.build(
            rank, targets, reader.class_load_pieces(rank, infos, entries, peers[rank],
                                                    of(rank))
            if classes else [p for part, _ in parts.values() for p in part]))
        built[rank] = seconds
        read_bytes.append(shared.read_bytes)
    sim.all_reduce("agree", 8)
    return {"ranks": len(ranks), **clock.summary(built), **sim.summary(),
            "columns": replicas.columns, "classes": classes,
            "classes_of_one": sum(len(replicas.of(r)[0]) < 2 for r in ranks) if classes else 0,
            "read_bytes_max_sampled": max(read_bytes),
            **storage_copies(state, of, ranks, classes)}


SCHEDULE = {"max_lr": 3e-4, "warmup_steps": 2000, "num_steps": 1000, "decay_style": "cosine",
            "lr_decay_steps": 1_000_000, "min_lr": 3e-5, "start_wd": 0.1, "end_wd": 0.1,
            "wd_incr_style": "constant", "wd_incr_steps": 1_000_000}
"""An lr schedule's state as a copy holds it (mcore ``OptimizerParamScheduler``'s
``state_dict`` fields), for its pickled size."""


def restore_case(layout: Layout, new: Layout, dead: list[int], state: State,
                 new_state: State, before: bool = False) -> dict[str, Any]:
    """``reshard.restore``'s planning after an in-place recovery from ``layout`` to
    ``new`` (the GPUs ``dead`` lost, with their copies), every rank of the new world
    (every GPU alive) simulated: each holds its own state of ``layout`` and the replica
    of its source (``memory_tier.replica_partners``: the ranks' nodes of 8), at two
    steps, as the tier's two versions; it sends the owners of its tensors what it
    holds and needs (``reshard.requests``), the ranks agree on the newest step (two
    ``all_reduce``s, the durable step's and the step tried), each owner plans
    (``reshard.owner_plan``) and tells senders and receivers their moves
    (``reshard.told``, ``reshard.rank_plan``). With ``before``, the plan it replaced:
    every rank's copies and needs gathered to every rank (``all_gather_object``) and
    the whole job's plan (``reshard.plan_restore``), timed once (every rank computed
    the same)."""
    alive = sorted(set(layout.ranks) - set(dead))
    partners = replica_partners(layout.ranks, {r: r // GPUS_PER_NODE for r in layout.ranks})
    source_of = {partner: rank for rank, partner in partners.items()}

    def held(rank: int) -> list[Holding]:
        return [Holding(owner, step, tuple(state(owner)), (), dict(SCHEDULE, num_steps=step))
                for step in (STEP, STEP - 1) for owner in {rank, source_of[rank]}]

    sim, clock = SimComm(alive), RankClock()
    sim.all_reduce("agree", 16)
    outbox: dict[int, dict[int, bytes]] = {}
    for rank in alive:
        copies, needed = held(rank), new_state(rank)
        for dest, blob in clock.run(rank, lambda: comm.pickled(reshard.requests(
                rank, copies, needed, alive))).items():
            outbox.setdefault(dest, {})[rank] = blob
    sim.exchange("plan", outbox)
    sim.all_reduce("agree", 8)
    sim.all_reduce("agree", 24)
    replies: dict[int, dict[int, bytes]] = {}
    moves = 0
    for owner, inbox in outbox.items():
        received = receive(clock, owner, inbox)
        plan = clock.run(owner, lambda: reshard.owner_plan(received, None, lambda v: v))
        assert plan.step == STEP, plan.step
        moves += len(plan.moves)
        for rank, blob in clock.run(owner, lambda: comm.pickled(reshard.told(plan))).items():
            replies.setdefault(rank, {})[owner] = blob
    del outbox
    sim.exchange("plan", replies)
    for rank in alive:
        parts = receive(clock, rank, replies.pop(rank, {}))
        clock.run(rank, lambda: reshard.rank_plan(STEP, parts))
    out = {"ranks": len(alive), **clock.summary(), **sim.summary(), "moves": moves}
    if before:
        copies = {rank: held(rank) for rank in alive}
        needs = {rank: new_state(rank) for rank in alive}
        sizes = {rank: len(pickle.dumps((copies[rank], needs[rank], None))) for rank in alive}
        whole = SimComm(alive)
        whole.all_gather_sizes("plan", sizes)
        seconds, plan = cpu(lambda: reshard.plan_restore(copies, needs, None))
        out["before"] = {"plan_cpu_s_max": seconds, "moves": len(plan.moves),
                         **whole.summary()}
    return out


STEP = 100
"""The newest step the copies hold (the older version one less)."""


def storage_copies(state: State, of: RankReplicas, ranks: list[int],
                   classes: bool) -> dict[str, float]:
    """How many times storage serves each byte of a load (docs/checkpoint-format.md,
    "Replicas"): with ``classes``, once per class holding it (a rank in no class, or
    each rank of disjoint state or of a grid's tensors, a class of its own: once, if
    the state is disjoint indeed); the most for any byte and the bytes served over
    the bytes loaded. Without classes the owners' plan reads each byte once."""
    if not classes:
        return {"storage_copies_max": 1, "storage_served_over_loaded": 1.0}
    holders = {}
    for rank in ranks:
        shared, alone = of(rank).split(state(rank))
        holders[rank] = (shared if of(rank).of(rank)[0][0] == rank else []) + alone
    dtypes = {i.key: i.dtype for infos in holders.values() for i in infos}
    served = unique = most = 0
    for cell in common_refinement(holders):
        copies = len(cell.holders)
        nbytes = cell.box.numel * DTYPE_ITEMSIZE[dtypes[cell.key]]
        served, unique, most = served + copies * nbytes, unique + nbytes, max(most, copies)
    return {"storage_copies_max": most, "storage_served_over_loaded": served / unique}


def saved_entries(recipe: Recipe, layout: Layout, state: State, zero1: bool
                  ) -> dict[str, Any]:
    """The entries (chunk and file grids) of the checkpoint a uniform ``layout`` saves:
    from its first pipeline, whose shards every other pipeline repeats; under ZeRO-1
    from every rank (each holds its own rows)."""
    savers = layout.ranks if zero1 else [
        r for stage in layout.pipelines[0].stages for r in stage.ranks]
    return plan_tensors({r: state(r) for r in savers}, chunk_policy(recipe))[0]


def grad_case(recipe: Recipe, layout: Layout, samples: int) -> dict[str, Any]:
    """``grad_sync.Refinement.build`` as each rank runs it (``parallel.holders``): the
    layout's stage kinds, its own tensors' cells, every holder set of the job (whose
    groups every rank creates), its digests (``plan_rank``) and its reduction buckets
    (``reduction_plan``), on ``samples`` ranks; then each of its holder sets' check
    (an all-reduce of 16 bytes in that set's group) and the job-wide flag (8 bytes)."""
    ranks = list(layout.ranks)
    sim = SimComm(ranks)
    sim.all_reduce("agree", 8)
    per_rank = []
    for rank in sample_ranks(ranks, samples):
        tensors = model_tensors(recipe, layout, rank)

        def derive():
            placement = Placement(layout)
            plan = plan_rank(placement, rank, tensors, False, spans_stages)
            return plan, reduction_plan(plan.cells, plan.sets, rank)
        seconds, (plan, buckets) = cpu(derive)
        seconds = min(seconds, *(cpu(derive)[0] for _ in range(2)))
        assert not plan.problems, plan.problems
        per_rank.append({"rank": rank, "plan_s": seconds, "cells": len(plan.cells),
                         "buckets": len(buckets), "groups_created": len(plan.groups),
                         "group_members_listed": sum(len(g) for g in plan.groups),
                         "checks": len(plan.digests),
                         "check_bytes": 2 * 2 * 16 * len(plan.digests)})
    summary = sim.summary()
    checks = max(p["check_bytes"] for p in per_rank)
    return {"ranks": len(ranks), "per_rank": per_rank, **summary,
            "max_exchanged_bytes": summary["max_exchanged_bytes"] + checks,
            "plan_cpu_s_max": max(p["plan_s"] for p in per_rank)}


def model_tensors(recipe: Recipe, layout: Layout, rank: int) -> list[LocalTensor]:
    """``rank``'s model shards (``layout_shard_infos``) with the dimension TP splits each
    (``stage_tensors``), as ``Refinement.build`` reads them from the model."""
    position = layout.position(rank)
    stages = layout.pipelines[position.pipeline].stages
    dims = {key: dim for key, (_, dim) in stage_tensors(
        recipe.model, layout.layer_range(position.pipeline, position.stage),
        position.stage == 0, position.stage == len(stages) - 1).items()}
    return [LocalTensor(info, dims[info.key])
            for info in layout_shard_infos(recipe.model, layout, rank, prefixes=("",))]


def planner_case(recipe: Recipe, world: int, lost: list[int]) -> tuple[dict, Layout | None]:
    hardware = load_hardware(HARDWARE)
    alive = [g for g in range(world) if g not in set(lost)]
    try:
        seconds, result = cpu(lambda: plan(recipe, hardware, alive))
    except PlannerError as exc:
        return {"error": str(exc)}, None
    return {"cpu_s": seconds, "gpus_used": result.layout.num_gpus, "step_s": result.step_s,
            "pipelines": len(result.layout.pipelines), "uniform": result.layout.is_uniform,
            "layout": result.layout.describe()[:120]}, result.layout


# --------------------------------------------------------------------------- driver


def replicas_of(layout: Layout, replicated: bool, zero1: bool = False) -> Replicas:
    """The layout's replica classes (``parallel.shards.replica_classes``), as every
    rank builds them once per layout (not per save or load), indexed; or none; under
    ZeRO-1 none and ``disjoint``, as the trainer passes them
    (``runtime.state.state_replicas``), or with ``--no-replicas`` none at all (each
    tensor's owner plans its reads, as the trainer's ZeRO-1 loads did before)."""
    if not replicated:
        return NO_REPLICAS
    if zero1:
        return Replicas(disjoint=True)
    replicas = Replicas(replica_classes(layout))
    replicas.of(layout.ranks[0])
    return replicas


def run(models: list[str], worlds: list[int], lost: list[int], samples: int,
        only: set[str], replicated: bool = True, zero1: bool = False,
        megatron_lm: bool = False, before: bool = False) -> list[dict]:
    """Every case of ``models`` x ``worlds`` x ``lost``. With ``megatron_lm`` the
    state of Megatron-LM's zarr saves under Elastor's ZeRO-1 (``MegatronLMState``),
    on the failure layouts only: on a uniform layout Megatron-LM's own distributed
    optimizer runs, whose state Megatron shards over data parallelism, planned per
    tensor (``zarr_format.state_replicas``)."""
    rows = []
    for name in models:
        base = load_recipe(REPO / "recipes" / f"{name}.yaml")
        for world in worlds:
            built = uniform(base, world)
            if built is None:
                print(f"{name} @ {world}: no uniform layout ({UNIFORM[name]}) fits "
                      f"{world} GPUs; skipped", flush=True)
                rows.append({"model": name, "world": world, "skipped": "no uniform layout"})
                continue
            recipe, layout = built
            row: dict[str, Any] = {"model": name, "world": world, "zero1": zero1,
                                   "megatron_lm": megatron_lm,
                                   "uniform": layout.describe()[:80]}
            entries: dict[str, Any] = {}
            if {"uniform", "save"} <= only and not megatron_lm:
                state = state_of(recipe, layout, zero1)
                row["save_uniform"] = (disjoint_save_case(recipe, layout, state)
                                       if zero1 and replicated
                                       else save_case(recipe, layout, state,
                                                      replicas_of(layout, replicated, zero1)))
                report(name, world, "save uniform", row["save_uniform"])
            if {"uniform", "grad"} <= only:
                row["grad_uniform"] = grad_case(recipe, layout, samples)
                report(name, world, "grad uniform", row["grad_uniform"])
            for k in lost:
                dead = lost_gpus(world, k)
                planned, hetero = planner_case(recipe, world, dead)
                case = {"lost": k, "dead": dead, "planner": planned}
                print(f"{name} @ {world} - {k}: planner {planned.get('cpu_s', -1):.3f} s "
                      f"{planned.get('layout', planned.get('error'))}", flush=True)
                if hetero is not None:
                    replicas_s, replicas = cpu(lambda: replicas_of(hetero, replicated, zero1))
                    case["replicas_s"] = replicas_s
                    state = state_of(recipe, hetero, zero1, megatron_lm)
                    if megatron_lm:
                        replicas = state.replicas
                    if "save" in only:
                        case["save"] = (
                            disjoint_save_case(recipe, hetero, state)
                            if zero1 and replicated
                            else save_case(recipe, hetero, state, replicas,
                                           state.files if megatron_lm else lambda rank: []))
                        report(name, world, f"save lost {k}", case["save"])
                    if "load" in only:
                        entries = entries or saved_entries(
                            recipe, layout, state_of(recipe, layout, zero1, megatron_lm),
                            zero1 or megatron_lm)
                        case["load"] = load_case(hetero, state, samples, entries, replicas)
                        report(name, world, f"load lost {k}", case["load"])
                    if "grad" in only:
                        case["grad"] = grad_case(recipe, hetero, samples)
                        report(name, world, f"grad lost {k}", case["grad"])
                    if "restore" in only:
                        case["restore"] = restore_case(
                            layout, hetero, dead, state_of(recipe, layout, zero1), state,
                            before)
                        report(name, world, f"restore lost {k}", case["restore"])
                        if before:
                            report(name, world, f"restore lost {k} (before)",
                                   {"ranks": case["restore"]["ranks"],
                                    **case["restore"]["before"]})
                row.setdefault("failures", []).append(case)
            rows.append(row)
            gc.collect()
    return rows


def report(model: str, world: int, what: str, case: dict) -> None:
    extra = ""
    if "manifest_bytes" in case:
        extra = (f", manifest {case['manifest_bytes'] / 1e6:.2f} MB, {case['files']} files, "
                 f"writer balance {case['writer_balance']:.2f}")
    print(f"{model} @ {world} {what}: {case['ranks']} ranks, plan CPU "
          f"{case['plan_cpu_s_max']:.3f} s/rank, exchanged "
          f"{case['max_exchanged_bytes'] / 1e6:.2f} MB/rank, "
          f"{case['job_wide_steps']} job-wide steps ({case['job_wide_calls']} calls){extra}",
          flush=True)


def _steps(case: dict) -> tuple[int, int]:
    """(job-wide steps, calls); the tool's run of the code before the plan step
    (``docs/bench_scale_before.json``, the tool of commit a532409) counted each
    collective as both: each was a step of its own."""
    old = case.get("job_wide_collectives")
    return case.get("job_wide_steps", old), case.get("job_wide_calls", old)


def markdown(rows: list[dict]) -> str:
    """One table per model: a row per world and case (the uniform layout's save, then
    each failure's save, load and planner)."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        out += [f"**{model}**", "",
                "| GPUs | case | ranks | save CPU s/rank | save MB/rank | save steps (calls) "
                "| load CPU s/rank | load MB/rank | load steps (calls) | manifest MB | files "
                "| writer max/mean | planner s |",
                "| " + " | ".join(["---"] * 13) + " |"]
        for row in (r for r in rows if r["model"] == model):
            if "skipped" in row:
                out.append(f"| {row['world']:,} | {row['skipped']} |" + " |" * 11)
                continue
            cases = [("uniform", row["save_uniform"], None, None)] if "save_uniform" in row else []
            cases += [(f"lost {f['lost']}", f.get("save"), f.get("load"), f["planner"])
                      for f in row.get("failures", [])]
            for name, save, load, planner in cases:
                cells = [f"{row['world']:,}", name]
                cells.append(str((save or load or {}).get("ranks", "")))
                for case in (save, load):
                    cells += ([f"{case['plan_cpu_s_max']:.3f}",
                               f"{case['max_exchanged_bytes'] / 1e6:.2f}",
                               "{} ({})".format(*_steps(case))]
                              if case else ["", "", ""])
                cells += ([f"{save['manifest_bytes'] / 1e6:.2f}", f"{save['files']:,}",
                           f"{save['writer_balance']:.2f}"] if save else ["", "", ""])
                cells.append("" if planner is None else
                             f"{planner['cpu_s']:.3f}" if "cpu_s" in planner else "no layout")
                out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def planner_markdown(rows: list[dict]) -> str:
    """The planner's search per model, world and failure: its CPU time, the GPUs its
    layout uses and the step the cost model predicts for it."""
    out = ["| model | GPUs | lost | planner s | GPUs used | pipelines | predicted step s |",
           "| " + " | ".join(["---"] * 7) + " |"]
    for row in rows:
        for failure in row.get("failures", []):
            planner = failure["planner"]
            cells = [row["model"], f"{row['world']:,}", str(failure["lost"])]
            cells += ([f"{planner['cpu_s']:.3f}", f"{planner['gpus_used']:,}",
                       str(planner["pipelines"]),
                       f"{planner['step_s']:.2f}" if "step_s" in planner else ""]
                      if "cpu_s" in planner else ["no layout", "", "", ""])
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def curve_markdown(model: str, lost: int, runs: dict[str, list[dict]],
                   kinds: tuple[str, ...] = ("save", "load")) -> str:
    """Per-rank plan CPU and bytes of ``model``'s ``kinds`` of plan (save, load, grad)
    after losing ``lost`` GPUs, per world, for each run (``runs``: a label and its
    rows), and each figure's growth from the smallest world to the largest."""
    header = ["GPUs"] + [f"{label} {kind} {what}" for label in runs for kind in kinds
                         for what in ("CPU s", "MB")]
    width = 2 * len(kinds)
    figures: dict[int, list[float | None]] = {}
    for i, rows in enumerate(runs.values()):
        for row in rows:
            if row["model"] != model:
                continue
            case = next((f for f in row.get("failures", []) if f["lost"] == lost), {})
            cells = figures.setdefault(row["world"], [None] * width * len(runs))
            for j, kind in enumerate(kinds):
                if kind in case:
                    cells[width * i + 2 * j] = case[kind]["plan_cpu_s_max"]
                    cells[width * i + 2 * j + 1] = case[kind]["max_exchanged_bytes"] / 1e6
    worlds = sorted(w for w, cells in figures.items() if any(c is not None for c in cells))
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join(["---"] * len(header)) + " |"]
    for world in worlds:
        out.append("| " + " | ".join([f"{world:,}"] + [
            "" if c is None else f"{c:.3f}" if k % 2 == 0 else f"{c:.2f}"
            for k, c in enumerate(figures[world])]) + " |")
    if len(worlds) > 1:
        first, last = figures[worlds[0]], figures[worlds[-1]]
        out.append("| " + " | ".join([f"growth {worlds[0]:,} -> {worlds[-1]:,}"] + [
            "" if a is None or b is None else f"{b / a:.1f}x" for a, b in zip(first, last)])
            + " |")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama3-8b,llama3-70b,llama3-405b")
    parser.add_argument("--worlds", default="64,512,4096,16384")
    parser.add_argument("--lost", default="1,8,64",
                        help="GPUs lost, each a failure case ('': the uniform layout's "
                             "cases alone)")
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--only", default="uniform,save,load,grad",
                        help="which plans to run (the planner always runs): the save, "
                             "load, grad and restore (in-place, from the copies in "
                             "memory) cases of each failure layout, and with 'uniform' "
                             "the uniform layout's save and grad")
    parser.add_argument("--out", default="bench_scale.json")
    parser.add_argument("--no-replicas", action="store_true",
                        help="plan as without the layout's replica classes (one owner per "
                             "tensor hearing from every holder; with --zero1, the loads "
                             "without disjoint and the saves without the grid)")
    parser.add_argument("--zero1", action="store_true",
                        help="the state under the distributed optimizer (the recipes' "
                             "distributed_optimizer: true): each rank holds its own rows "
                             "of the main weights and moments, none replicated")
    parser.add_argument("--megatron-lm", action="store_true",
                        help="the state of Megatron-LM's zarr saves under Elastor's ZeRO-1 "
                             "(bf16 weights replicated over the replica classes, ZeRO-1's "
                             "state on its grid, ShardedObjects as named files), on the "
                             "failure layouts")
    parser.add_argument("--before", action="store_true",
                        help="with --only restore: also the whole-job restore plan it "
                             "replaced (every rank's copies gathered to every rank)")
    parser.add_argument("--table", nargs="+", metavar="JSON",
                        help="print the tables of earlier runs' JSON files and exit")
    parser.add_argument("--planner-table", nargs="+", metavar="JSON",
                        help="print the planner's table of earlier runs and exit")
    parser.add_argument("--curve", nargs=2, metavar=("MODEL", "LOST"),
                        help="with --table: MODEL's plans (--kinds) after LOST lost GPUs "
                             "per world, a column group per JSON file, and the growth")
    parser.add_argument("--kinds", default="save,load",
                        help="with --curve: which plans (save, load, grad)")
    args = parser.parse_args()
    if args.planner_table:
        print(planner_markdown([r for path in args.planner_table
                                for r in json.loads(Path(path).read_text())["rows"]]))
        return 0
    if args.table:
        runs = {Path(path).stem: json.loads(Path(path).read_text())["rows"]
                for path in args.table}
        print(curve_markdown(args.curve[0], int(args.curve[1]), runs,
                             tuple(args.kinds.split(","))) if args.curve
              else markdown([r for rows in runs.values() for r in rows]))
        return 0
    gc.disable()
    rows = run(args.models.split(","), [int(w) for w in args.worlds.split(",")],
               [int(k) for k in args.lost.split(",") if k], args.samples,
               set(args.only.split(",")), not args.no_replicas, args.zero1, args.megatron_lm,
               args.before)
    Path(args.out).write_text(json.dumps({"rows": rows}, indent=1))
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
