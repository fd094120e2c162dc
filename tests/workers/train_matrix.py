"""Test worker: train, save, load and verify several layouts in one torchrun world.

Starting a world costs seconds per rank here (mcore imports), so the test modules
that train layouts share one (``tests/train_world.py``). Each ``--case NAME=LAYOUT:STEPS[,recipe=PATH][,save=DIR][,load=DIR][,verify][,tier][,restore=NAME[,drop=all|even][,durable=DIR]]``:

* loads its recipe (``recipe``, else ``--recipe``: cases may differ in precision, so an
  fp32 checkpoint can be resumed in bf16 and back) and sets up the layout (ranks it
  does not use sit idle);
* with ``load``, resumes from the latest step under DIR; with ``verify``, then writes
  every local shard it loaded (weights and Adam moments) to
  ``<out>/<name>/loaded.rank<r>.pt``, for the test to compare with what was saved;
* trains until step STEPS, writing ``<out>/<name>/metrics.json`` (reporting rank) and
  ``<out>/<name>/rank<r>.pt``: every ShardedTensor this rank holds, as
  ``{key: (global_offset, tensor)}``, from which the test rebuilds the full weights;
* with ``save``, saves the final state synchronously under DIR, and writes the same
  local shards with ``torch.save`` to ``DIR.state/rank<r>.pt``: what the saving ranks
  held, independent of the checkpoint's read path, for the resharding test.

With ``tier`` the case keeps the in-memory tier (``runtime.memory_tier``, snapshot
after every optimizer step, a replica on the partner; nodes of 4 ranks) and writes
``<out>/<name>/copies.rank<r>.pt``: every complete copy the rank holds, as ``[{owner,
step, shards}]``. A later case ``restore=NAME`` sets up its own layout and fills its
state from the copies every rank holds of case NAME (``runtime.reshard.restore``,
collective), with ``drop=all|even`` pretending that every (even) world rank lost its
copies and ``durable=DIR`` the checkpoint root the rest comes from; it writes
``restored.rank<r>.pt`` (shard file) and ``restored.rank<r>.json`` (step, bytes
received, cells read from the checkpoint). NAME is a case of the same directory.

Shard files hold ``[(key, global_shape, global_offset, tensor), ...]``. A case's name
may be a relative path (``tests/train_world.py`` puts each test module's cases in a
directory of its own).

Two measurements follow a case's training (the ZeRO-1 tests):

* ``--memory NAME``: every rank of case NAME writes ``<out>/<NAME>/memory.rank<r>.json``:
  what ``elastor train --report-memory`` prints for it (bytes of fp32 main parameters
  and moments its optimizer holds, measured on its tensors; its parameter count; the
  formula, ``12 * numel / replicas`` under ZeRO-1) and under ZeRO-1 the plan's owned
  bytes; and the start-up: the bytes of the tensors building its optimizer allocated,
  at their peak and kept (``setup_stage(measure_startup=True)``), beside its gradient
  buffers' and, under ZeRO-1, what it allocated for its shard;
* ``--native-check NAME``: after ZeRO-1 case NAME, every rank reduces the last step's
  gradients again both ways (``DistributedOptimizer.reduce``: gloo's all-reduce
  emulation, and ``reduce_scatter_tensor`` on the padded buffer, the NCCL path) and
  writes how far they differ to ``<out>/<NAME>/native.rank<r>.json``.
"""

import argparse
import json
import logging
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from elastor_mcore import checkpoint
from elastor_mcore.runtime.distributed_optimizer import DistributedOptimizer, planned_state_bytes
from elastor_mcore.runtime import reshard
from elastor_mcore.runtime.memory_tier import MemoryTier
from elastor_mcore.runtime.state import (
    chunk_policy, manifest_fields, set_position, state_replicas, state_shards)
from elastor_mcore.compat import cpu
from elastor_mcore.data.samples import SyntheticTokens
from elastor_mcore.parallel.groups import GroupCache
from elastor_mcore.parallel.layout import load_layout
from elastor_mcore.config.recipe import load_recipe
from elastor_mcore.parallel.shards import sharded_tensors
from elastor_mcore.runtime.grad_sync import grad_buffer
from elastor_mcore.runtime.train import optimizer_memory, resume, setup_stage, train_steps

LOG = logging.getLogger("train_matrix")


def parse_case(spec: str) -> dict:
    name, rest = spec.split("=", 1)
    main, *options = rest.split(",")
    layout, steps = main.rsplit(":", 1)
    case = {"name": name, "layout": layout, "steps": int(steps)}
    for option in options:
        key, _, value = option.partition("=")
        case[key] = value or True
    return case


def dump_shards(runner, path: Path) -> None:
    """This rank's training-state shards (weights and Adam moments), copied."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save([(s.key, tuple(s.global_shape), tuple(s.global_offset), s.data.detach().clone())
                for s in state_shards(runner.model, runner.optimizer)], path)


TIERS: dict[str, MemoryTier | None] = {}
"""Each ``tier`` case's in-memory tier on this rank, for later ``restore`` cases."""


def dump_copies(tier: MemoryTier, path: Path) -> None:
    torch.save([{"owner": h.owner, "step": h.step,
                 "shards": [(i.key, i.global_shape, i.box.offset, v.clone())
                            for i, v in zip(h.shards, h.views(buffer))]}
                for h, buffer in tier.copies()], path)


def restore_case(case: dict, runner, out: Path) -> int:
    """Fill this rank's state from case ``restore``'s copies (every world rank calls);
    returns the step restored."""
    rank = dist.get_rank()
    drop = case.get("drop")
    source = TIERS[str(Path(case["name"]).parent / case["restore"])]  # a sibling case
    lost = drop == "all" or (drop == "even" and rank % 2 == 0)
    copies = source.copies() if source is not None and not lost else []
    targets = state_shards(runner.model, runner.optimizer) if runner is not None else []
    restored = reshard.restore(targets, copies, case.get("durable"))
    if runner is None:
        return restored.step
    set_position(runner.optimizer, restored.step, restored.schedule)
    runner.optimizer.copy_main_to_model()
    dump_shards(runner, out / f"restored.rank{rank}.pt")
    (out / f"restored.rank{rank}.json").write_text(json.dumps(
        {"step": restored.step, "received_bytes": restored.received_bytes,
         "durable_cells": restored.durable_cells}))
    return restored.step


def run_case(case: dict, default_recipe: str | None, cache: GroupCache, out_root: Path,
             measure_startup: bool = False):
    """Run one case; returns this rank's ``StageRunner`` (None on idle ranks)."""
    recipe_path = case.get("recipe", default_recipe)
    if recipe_path is None:
        raise SystemExit(f"case {case['name']} names no recipe and --recipe is not given")
    recipe = load_recipe(recipe_path)
    layout = load_layout(case["layout"], recipe)
    out = out_root / case["name"]
    out.mkdir(parents=True, exist_ok=True)
    seed = recipe.training.seed
    runner = setup_stage(recipe, layout, seed, cache, initialize="restore" not in case,
                         measure_startup=measure_startup)
    tier = None
    if "tier" in case:  # collective over the world
        shards = state_shards(runner.model, runner.optimizer) if runner is not None else []
        tier = TIERS[case["name"]] = MemoryTier.build(shards, layout.ranks,
                                                      {r: r // 4 for r in layout.ranks})
    start = restore_case(case, runner, out) if "restore" in case else 0
    if runner is None:
        return None
    if "load" in case:
        start = resume(runner, case["load"], seed)
    if "verify" in case:
        dump_shards(runner, out / f"loaded.rank{dist.get_rank()}.pt")
    source = SyntheticTokens(recipe.model.vocab_size, recipe.model.seq_length, seed)

    def copy_to_memory(done: int) -> None:
        tier.wait()
        tier.snapshot(done, runner.optimizer.scheduler.state_dict())

    metrics = train_steps(runner, source, range(start, case["steps"]),
                          on_update=copy_to_memory if tier else None)
    if tier:
        tier.wait()
        dump_copies(tier, out / f"copies.rank{dist.get_rank()}.pt")
    if metrics:
        (out / "metrics.json").write_text(json.dumps([m.__dict__ for m in metrics]))
    shards = {st.key: (tuple(st.global_offset), st.data.detach().clone())
              for st in sharded_tensors(runner.model)}
    torch.save(shards, out / f"rank{dist.get_rank()}.pt")
    if "save" in case:
        dump_shards(runner, Path(case["save"] + ".state") / f"rank{dist.get_rank()}.pt")
        checkpoint.save(case["save"], case["steps"],
                        state_shards(runner.model, runner.optimizer),
                        manifest_fields(recipe, layout, case["steps"], seed, runner.optimizer),
                        group=runner.groups.active, chunking=chunk_policy(recipe),
                        replicas=state_replicas(runner.groups.layout, runner.optimizer))
    return runner


def measure_memory(runner, out: Path) -> None:
    """What ``--report-memory`` reports (``train.optimizer_memory``, collective), and
    under ZeRO-1 the plan's owned bytes."""
    rank = dist.get_rank()
    mine = next(m for m in optimizer_memory(runner) if m.rank == rank)
    report = {"state_bytes": mine.state_bytes, "params": mine.params,
              "formula_bytes": mine.expected_bytes, "sharded": mine.sharded,
              "build_peak": runner.startup.built_peak, "build_kept": runner.startup.built_kept,
              "grad_bytes": sum(grad_buffer(p).nbytes for p in runner.model.parameters())}
    if isinstance(runner.optimizer, DistributedOptimizer):
        report["planned_bytes"] = planned_state_bytes(runner.optimizer.plan.buckets, rank)[0]
        report["shard_bytes"] = runner.optimizer.nbytes()
    (out / f"memory.rank{rank}.json").write_text(json.dumps(report))


def check_native_reduce(runner, out: Path) -> None:
    optimizer = runner.optimizer
    optimizer.reduce(native=False)
    emulated = [g.clone() for g in optimizer.owned_grads()]
    optimizer.reduce(native=True)
    native = optimizer.owned_grads()
    flat_e = torch.cat([g.reshape(-1) for g in emulated])
    flat_n = torch.cat([g.reshape(-1) for g in native])
    weights = [p.data for p in runner.model.parameters()]
    optimizer.copy_main_to_model(native=False)
    reduced = [w.clone() for w in weights]
    for w in weights:
        w.fill_(float("nan"))  # a weight the gather below missed stays NaN
    optimizer.copy_main_to_model(native=True)
    report = {"elements": flat_e.numel(), "differing": int((flat_e != flat_n).sum()),
              "max_abs_diff": float((flat_e - flat_n).abs().max()),
              "max_abs": float(flat_e.abs().max()),
              "gathered_alike": all(torch.equal(a, b) for a, b in zip(reduced, weights))}
    (out / f"native.rank{dist.get_rank()}.json").write_text(json.dumps(report))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default=None, help="for cases without recipe=PATH")
    parser.add_argument("--out", required=True)
    parser.add_argument("--case", action="append", required=True)
    parser.add_argument("--memory", action="append", default=[])
    parser.add_argument("--native-check", action="append", default=[])
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    cpu.apply()
    dist.init_process_group("gloo")
    cache = GroupCache()
    out = Path(args.out)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for spec in args.case:
        case = parse_case(spec)
        started, cpu_started = time.perf_counter(), time.process_time()
        runner = run_case(case, args.recipe, cache, out, case["name"] in args.memory)
        cpu_seconds = torch.tensor([time.process_time() - cpu_started], dtype=torch.float64)
        dist.all_reduce(cpu_seconds)  # also waits for the case's slowest rank
        if dist.get_rank() == 0:  # what each case costs, for trimming the world
            LOG.info("case %s: %.2f s wall, %.2f CPU-s of all ranks", case["name"],
                     time.perf_counter() - started, cpu_seconds.item())
        if runner is not None and case["name"] in args.memory:
            measure_memory(runner, out / case["name"])
        if runner is not None and case["name"] in args.native_check:
            check_native_reduce(runner, out / case["name"])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
