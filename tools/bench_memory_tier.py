"""What the in-memory tier costs a training step: the same layout trained with the
tier off and on, in alternating blocks of one torchrun world, through the training
loop itself (``runtime.train.run_steps``).

    python tools/bench_memory_tier.py [--slots 8] [--layout SPEC] [--rounds 4]
                                      [--steps 6] [--out bench_memory_tier.json]

Default layout: the planner's for ``elastor demo``'s 8 slots (its hardware profile,
every slot busy). A step is timed from the end of the previous step to its own end
(``StepHooks.step_end``), so it includes the wait for the copy (``MemoryTier.wait``);
the first step of each block is left out. Printed and written to ``--out``: the median
step with the tier off and on and their ratio; on every rank, the copy into host
memory, the replica's transfer and the time the loop waited for them (means); and the
bytes each rank keeps per copy. The figure the tier is held to: its cost per step,
at most 5 % of the median step. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TINY = ROOT / "recipes" / "tiny-llama.yaml"
DEMO_HARDWARE = ROOT / "recipes" / "hardware" / "cpu-slots-2.25mib.yaml"


def demo_layout(slots: int):
    from elastor_mcore.config.recipe import load_recipe
    from elastor_mcore.planner import load_hardware, plan

    return plan(load_recipe(TINY), load_hardware(DEMO_HARDWARE), range(slots),
                use_all=True).layout


def run_ranks(args: argparse.Namespace) -> None:
    """Inside the world: alternate blocks with the tier off and on; rank 0 writes the
    step times and every rank's tier timings to ``args.times``."""
    import torch.distributed as dist

    from elastor_mcore.compat import cpu
    from elastor_mcore.config.recipe import load_recipe
    from elastor_mcore.config.run import RunSettings
    from elastor_mcore.data.samples import SyntheticTokens
    from elastor_mcore.parallel.groups import GroupCache
    from elastor_mcore.parallel.layout import layout_from_dict, load_layout
    from elastor_mcore.runtime.hooks import StepHooks
    from elastor_mcore.runtime.train import (RunConfig, Session, memory_tier, run_steps,
                                             setup_stage, snapshot)

    class Clock(StepHooks):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def step_end(self, step: int) -> None:
            self.ends.append(time.perf_counter())

    cpu.apply()
    dist.init_process_group("gloo")
    recipe = load_recipe(TINY)
    layout = load_layout(args.layout, recipe) if args.layout else \
        layout_from_dict(json.loads(args.layout_json))
    settings = RunSettings(recipe=str(TINY), steps=0, hardware=str(DEMO_HARDWARE),
                           memory_interval=1)
    clock = Clock()
    cfg = RunConfig(recipe, layout, settings, hooks=clock)
    runner = setup_stage(recipe, layout, recipe.training.seed, GroupCache())
    tier = memory_tier(runner, cfg)
    times: dict[str, list[float]] = {"off": [], "on": []}
    step = 0
    for _ in range(args.rounds):
        for mode in ("off", "on"):
            dist.barrier()
            if runner is None:
                continue
            block = replace(cfg, settings=replace(settings, steps=step + args.steps))
            source = SyntheticTokens(recipe.model.vocab_size, recipe.model.seq_length,
                                     recipe.training.seed)
            session = Session(block, runner, source, None, tier if mode == "on" else None,
                              step)
            snapshot(session, step)
            clock.ends = [time.perf_counter()]
            run_steps(session, [])
            times[mode] += [b - a for a, b in zip(clock.ends[1:], clock.ends[2:])]
            step += args.steps
    rank = dist.get_rank()
    mine = {"rank": rank, "times": times,
            "tier": [{"step": s, "copy_s": c, "replica_s": r, "wait_s": w}
                     for s, c, r, w in tier.timings] if tier else [],
            "bytes": tier.own[0].buffer.numel() if tier else 0,
            "replica_bytes": tier.replicas[0].buffer.numel() if tier and tier.replicas else 0}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        Path(args.times).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def summarise(ranks: list[dict], layout: str) -> dict:
    reporter = next(r for r in ranks if r["times"]["on"])
    off, on = (statistics.median(reporter["times"][m]) for m in ("off", "on"))
    tiers = [r for r in ranks if r["tier"]]

    def mean(rank: dict, key: str) -> float:
        return statistics.mean(t[key] for t in rank["tier"])

    wait = max(mean(r, "wait_s") for r in tiers)
    return {"layout": layout, "median_step_off_s": off, "median_step_on_s": on,
            "step_ratio": on / off - 1, "steps_timed": len(reporter["times"]["on"]),
            "wait_s_worst_rank": wait, "wait_of_median_step": wait / off,
            "copy_s_worst_rank": max(mean(r, "copy_s") for r in tiers),
            "replica_s_worst_rank": max(mean(r, "replica_s") for r in tiers),
            "bytes_per_rank_max": max(r["bytes"] for r in ranks),
            "load_average_1min": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--layout", default=None,
                        help="layout YAML or shorthand (default: elastor demo's for --slots)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6, help="steps per block (first left out)")
    parser.add_argument("--out", default="bench_memory_tier.json")
    parser.add_argument("--times", help=argparse.SUPPRESS)
    parser.add_argument("--layout-json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.times:
        run_ranks(args)
        return 0
    if args.steps < 3:
        parser.error("--steps must be at least 3 (the first step of a block is left out)")
    from elastor_mcore.elastic.torchrun import run_torchrun

    layout = None if args.layout else demo_layout(args.slots)
    described = args.layout or layout.describe()
    times = Path(args.out).with_suffix(".times.json")
    world = ["--layout", args.layout] if args.layout else \
        ["--layout-json", json.dumps(layout.to_dict())]
    print(f"bench_memory_tier: {described} on {args.slots} ranks, {args.rounds} rounds x "
          f"{args.steps} steps per mode, load average {os.getloadavg()[0]:.1f} ...", flush=True)
    result = run_torchrun(args.slots, "tools.bench_memory_tier",
                          [*world, "--rounds", str(args.rounds), "--steps", str(args.steps),
                           "--times", str(times)], env={"PYTHONPATH": str(ROOT)})
    if result.returncode:
        print(f"bench_memory_tier: the world failed (exit {result.returncode})")
        return 1
    figures = summarise(json.loads(times.read_text()), described)
    times.unlink()
    Path(args.out).write_text(json.dumps(figures, indent=1) + "\n")
    print(f"| tier | median step |\n|---|---|\n| off | {figures['median_step_off_s']:.3f} s |\n"
          f"| on | {figures['median_step_on_s']:.3f} s ({figures['step_ratio']:+.1%}) |")
    print(f"per copy (worst rank, means): host copy {figures['copy_s_worst_rank'] * 1e3:.2f} ms,"
          f" replica {figures['replica_s_worst_rank'] * 1e3:.2f} ms, the loop waited "
          f"{figures['wait_s_worst_rank'] * 1e3:.2f} ms = "
          f"{figures['wait_of_median_step']:.2%} of the median step; "
          f"{figures['bytes_per_rank_max']:,} bytes per rank and copy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
