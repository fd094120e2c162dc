"""Checkpoint planning, gradient cells and the planner on simulated worlds of up to
16,384 GPUs: the project's real planning code, no processes, no data.

    PYTHONPATH=. python tools/bench_scale.py [--models llama3-8b,llama3-70b,llama3-405b]
        [--worlds 64,512,4096,16384] [--lost 1,8,64] [--samples 3] [--out FILE]

Each rank's state is what ``parallel.shards.layout_shard_infos`` derives from the
layout and the recipe's shapes (the fp32 main weights and AdamW's two moments of the
rank's ShardedTensors; ``tests/test_bench_scale.py`` checks it against real mcore
``sharded_state_dict()`` metadata). Per model and world: the uniform layout Megatron
would use (``UNIFORM``), and the planner's layout after losing 1, 8 and 64 GPUs
scattered over the nodes. Per case:

* **save** under the uniform layout and under each failure layout: the writer
  assignment, the array metadata each rank creates, and the coordinator's manifest;
* **load** of the uniform layout's checkpoint under each failure layout: the reader's
  refinement and the assignment of shared reads;
* **grad cells**: the gradient-reduction cells and buckets (``runtime.grad_sync``);
* **planner**: ``planner.plan`` for the alive GPUs (H100-80GB profile).

Collectives go through ``SimComm``: a call that every rank of the job takes part in
is a job-wide collective; each records the bytes every rank sends and receives (the
pickled objects, as ``all_gather_object`` moves them: a rank receives every other
rank's object). Per-rank CPU is ``time.process_time`` of one rank's share of the
work (unpickling what it receives, then planning), on ``--samples`` ranks spread
over the job (where every rank computes the same whole-job plan, one sample stands
for all). Nothing here writes or reads storage.
"""

from __future__ import annotations

import argparse
import dataclasses
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

from elastor_mcore.checkpoint import plan as write_plan  # noqa: E402
from elastor_mcore.checkpoint import reader, writer  # noqa: E402
from elastor_mcore.checkpoint.format import Manifest  # noqa: E402
from elastor_mcore.checkpoint.plan import LocalShard  # noqa: E402
from elastor_mcore.config.recipe import Recipe, load_recipe  # noqa: E402
from elastor_mcore.geometry import common_refinement  # noqa: E402
from elastor_mcore.parallel.layout import Layout, layout_from_dict  # noqa: E402
from elastor_mcore.parallel.shards import layout_shard_infos  # noqa: E402
from elastor_mcore.planner import PlannerError, load_hardware, plan  # noqa: E402
from elastor_mcore.runtime.grad_sync import reduction_plan  # noqa: E402
from elastor_mcore.runtime.state import chunk_policy  # noqa: E402

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
    what: str
    job_wide: bool
    ranks: int
    max_sent: int
    max_received: int


@dataclass
class SimComm:
    """Moves picklable objects between simulated ranks and counts what it moves."""

    ranks: list[int]
    log: list[Collective] = field(default_factory=list)
    sent: dict[int, int] = field(default_factory=dict)
    received: dict[int, int] = field(default_factory=dict)

    def _count(self, what: str, sent: dict[int, int], received: dict[int, int],
               job_wide: bool = True) -> None:
        for rank, n in sent.items():
            self.sent[rank] = self.sent.get(rank, 0) + n
        for rank, n in received.items():
            self.received[rank] = self.received.get(rank, 0) + n
        self.log.append(Collective(what, job_wide, len(sent), max(sent.values(), default=0),
                                   max(received.values(), default=0)))

    def all_gather_sizes(self, what: str, sizes: dict[int, int]) -> None:
        """An ``all_gather_object`` of objects of these pickled sizes: each rank
        receives every other rank's object (and, in a ring, forwards as many bytes)."""
        total = sum(sizes.values())
        others = {r: total - sizes[r] for r in self.ranks}
        self._count(what, others, others)

    def all_gather_small(self, what: str, value: Any) -> None:
        """An ``all_gather_object`` where every rank contributes ``value`` (an error
        slot, ``None`` when all is well)."""
        self.all_gather_sizes(what, dict.fromkeys(self.ranks, len(pickle.dumps(value))))

    def summary(self) -> dict[str, Any]:
        return {"job_wide_collectives": sum(c.job_wide for c in self.log),
                "group_collectives": sum(not c.job_wide for c in self.log),
                "calls": [c.what for c in self.log],
                "max_sent_bytes": max(self.sent.values(), default=0),
                "max_received_bytes": max(self.received.values(), default=0),
                "max_exchanged_bytes": max((self.sent.get(r, 0) + self.received.get(r, 0)
                                            for r in self.ranks), default=0)}


def cpu(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.process_time()
    out = fn()
    return time.process_time() - start, out


def sample_ranks(ranks: list[int], n: int) -> list[int]:
    """``n`` ranks spread over the job, the first and the last included."""
    if n >= len(ranks):
        return list(ranks)
    return sorted({ranks[round(i * (len(ranks) - 1) / max(1, n - 1))] for i in range(n)})


# --------------------------------------------------------------------------- layouts


def scaled_recipe(recipe: Recipe, dp: int) -> Recipe:
    """The recipe with a global batch of at least one micro-batch per pipeline."""
    micro = recipe.training.total_micro_batches
    if micro % dp == 0:
        return recipe
    batch = -(-max(micro, dp) // dp) * dp * recipe.training.micro_batch_size
    return dataclasses.replace(recipe, training=dataclasses.replace(
        recipe.training, global_batch_size=batch))


def uniform(recipe: Recipe, world: int) -> tuple[Recipe, Layout] | None:
    tp, stages = UNIFORM[recipe.name]
    per_pipeline = tp * len(stages)
    if world % per_pipeline:
        return None
    dp = world // per_pipeline
    recipe = scaled_recipe(recipe, dp)
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


def pickled(recipe: Recipe, layout: Layout, wrap=lambda rank, infos: infos,
            prefixes=None) -> dict[int, bytes]:
    """Every rank's contribution to a gather, pickled (one rank's infos in memory at
    a time: 16,384 ranks' worth of ShardInfo objects would not fit twice)."""
    kwargs = {} if prefixes is None else {"prefixes": prefixes}
    return {r: pickle.dumps(wrap(r, layout_shard_infos(recipe.model, layout, r, **kwargs)))
            for r in layout.ranks}


def page_cache(rank: int) -> str:
    return f"node{rank // GPUS_PER_NODE}"


def save_case(recipe: Recipe, layout: Layout, samples: int) -> dict[str, Any]:
    """``writer._write_checkpoint``'s planning: validate and agree, gather the shard
    boxes, ``build_plan``, agree, the rank's units and metadata share, agree, the
    coordinator's manifest, agree."""
    ranks = list(layout.ranks)
    sim = SimComm(ranks)
    sim.all_gather_small("agree: validation", None)
    payloads = pickled(recipe, layout)
    sim.all_gather_sizes("all_gather: shard boxes", {r: len(p) for r, p in payloads.items()})
    policy = chunk_policy(recipe)
    per_rank, the_plan = [], None
    for rank in sample_ranks(ranks, samples):
        unpickle_s, gathered = cpu(lambda: {r: pickle.loads(p) for r, p in payloads.items()})
        the_plan = None
        plan_s, the_plan = cpu(lambda: write_plan.build_plan(gathered, policy))
        share_s, _ = cpu(lambda: (the_plan.units_of(rank), writer.metadata_creators(the_plan)))
        per_rank.append({"rank": rank, "unpickle_s": unpickle_s, "plan_s": plan_s,
                         "share_s": share_s, "total_s": unpickle_s + plan_s + share_s})
        del gathered
    sim.all_gather_small("agree: temporary directory", None)
    sim.all_gather_small("agree: writes", None)
    manifest_s, text = cpu(lambda: Manifest.build(
        0, the_plan.entries, len({u.writer for u in the_plan.units}),
        {"layout": layout.to_dict()}).to_json())
    sim.all_gather_small("agree: commit", None)
    loads = the_plan.bytes_by_rank()
    writers = [n for n in loads.values() if n]
    return {"ranks": len(ranks), "per_rank": per_rank, **sim.summary(),
            "plan_cpu_s_max": max(p["total_s"] for p in per_rank),
            "coordinator_manifest_s": manifest_s, "manifest_bytes": len(text),
            "tensors": len(the_plan.entries),
            "files": len(the_plan.units) + len(the_plan.entries) + 2,
            "writer_balance": max(writers) / statistics.mean(writers),
            "bytes": sum(e.nbytes for e in the_plan.entries.values())}


def load_case(recipe: Recipe, layout: Layout, samples: int) -> dict[str, Any]:
    """``reader._load``'s planning: agree on the step, gather every rank's targets and
    page cache, ``SharedReads.plan``, agree after the reads."""
    ranks = list(layout.ranks)
    sim = SimComm(ranks)
    sim.all_gather_small("all_gather: step directory", (None, "/checkpoints/step_00000000"))
    payloads = pickled(recipe, layout, lambda r, infos: (None, infos, page_cache(r)))
    sim.all_gather_sizes("all_gather: targets and page caches",
                         {r: len(p) for r, p in payloads.items()})
    per_rank = []
    for rank in sample_ranks(ranks, samples):
        targets = [LocalShard(i.key, i.global_shape, i.box.offset,
                              torch.empty(i.box.shape, device="meta"))
                   for i in layout_shard_infos(recipe.model, layout, rank)]
        unpickle_s, gathered = cpu(lambda: [pickle.loads(p) for p in payloads.values()])
        reader.comm.global_rank = lambda rank=rank: rank  # the simulated rank's view
        reader._carries_cpu = lambda group: True          # gloo: replicas share reads
        plan_s, shared = cpu(lambda: reader.SharedReads.plan(
            targets, {r: g[1] for r, g in zip(payloads, gathered)},
            {r: g[2] for r, g in zip(payloads, gathered)}))
        per_rank.append({"rank": rank, "unpickle_s": unpickle_s, "plan_s": plan_s,
                         "total_s": unpickle_s + plan_s, "read_bytes": shared.read_bytes,
                         "received_bytes": shared.received_bytes})
        del gathered
    sim.all_gather_small("agree: reads", None)
    return {"ranks": len(ranks), "per_rank": per_rank, **sim.summary(),
            "plan_cpu_s_max": max(p["total_s"] for p in per_rank)}


def grad_case(recipe: Recipe, layout: Layout, samples: int) -> dict[str, Any]:
    """``grad_sync.Refinement.build`` and ``reduction_plan``: gather every rank's model
    shards, their common refinement, the buckets of cells held in several pipelines."""
    ranks = list(layout.ranks)
    sim = SimComm(ranks)
    payloads = pickled(recipe, layout, prefixes=("",))
    sim.all_gather_sizes("all_gather: model shard boxes",
                         {r: len(p) for r, p in payloads.items()})
    pipeline_of = {r: layout.position(r).pipeline for r in ranks}
    per_rank = []
    for rank in sample_ranks(ranks, samples):
        unpickle_s, gathered = cpu(lambda: {r: pickle.loads(p) for r, p in payloads.items()})
        plan_s, buckets = cpu(lambda: reduction_plan(common_refinement(gathered), pipeline_of))
        mine = sum(rank in holders for holders in buckets)
        per_rank.append({"rank": rank, "unpickle_s": unpickle_s, "plan_s": plan_s,
                         "total_s": unpickle_s + plan_s, "buckets": mine})
        del gathered
    return {"ranks": len(ranks), "per_rank": per_rank, **sim.summary(),
            "plan_cpu_s_max": max(p["total_s"] for p in per_rank)}


def planner_case(recipe: Recipe, world: int, lost: list[int]) -> tuple[dict, Layout | None]:
    hardware = load_hardware(HARDWARE)
    alive = [g for g in range(world) if g not in set(lost)]
    try:
        seconds, result = cpu(lambda: plan(recipe, hardware, alive))
    except PlannerError as exc:
        return {"error": str(exc)}, None
    return {"cpu_s": seconds, "gpus_used": result.layout.num_gpus,
            "pipelines": len(result.layout.pipelines), "uniform": result.layout.is_uniform,
            "layout": result.layout.describe()[:120]}, result.layout


# --------------------------------------------------------------------------- driver


def run(models: list[str], worlds: list[int], lost: list[int], samples: int,
        only: set[str]) -> list[dict]:
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
            row: dict[str, Any] = {"model": name, "world": world,
                                   "uniform": layout.describe()[:80]}
            if "save" in only:
                row["save_uniform"] = save_case(recipe, layout, samples)
                report(name, world, "save uniform", row["save_uniform"])
            if "grad" in only:
                row["grad_uniform"] = grad_case(recipe, layout, samples)
                report(name, world, "grad uniform", row["grad_uniform"])
            for k in lost:
                dead = lost_gpus(world, k)
                planned, hetero = planner_case(recipe, world, dead)
                case = {"lost": k, "dead": dead, "planner": planned}
                print(f"{name} @ {world} - {k}: planner {planned.get('cpu_s', -1):.3f} s "
                      f"{planned.get('layout', planned.get('error'))}", flush=True)
                if hetero is not None:
                    if "save" in only:
                        case["save"] = save_case(recipe, hetero, samples)
                        report(name, world, f"save lost {k}", case["save"])
                    if "load" in only:
                        case["load"] = load_case(recipe, hetero, samples)
                        report(name, world, f"load lost {k}", case["load"])
                    if "grad" in only:
                        case["grad"] = grad_case(recipe, hetero, samples)
                        report(name, world, f"grad lost {k}", case["grad"])
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
          f"{case['job_wide_collectives']} job-wide collectives{extra}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama3-8b,llama3-70b,llama3-405b")
    parser.add_argument("--worlds", default="64,512,4096,16384")
    parser.add_argument("--lost", default="1,8,64")
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--only", default="save,load,grad",
                        help="which plans to run (the planner always runs)")
    parser.add_argument("--out", default="bench_scale.json")
    args = parser.parse_args()
    gc.disable()  # as a real save or load (checkpoint.gc_pause)
    rows = run(args.models.split(","), [int(w) for w in args.worlds.split(",")],
               [int(k) for k in args.lost.split(",")], args.samples,
               set(args.only.split(",")))
    Path(args.out).write_text(json.dumps({"rows": rows}, indent=1))
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
