"""Benchmark the layout planner: how fast it plans, and what it buys.

    PYTHONPATH=. python tools/bench_planner.py [--png planner_value.png]

1. Speed: plan llama3-70b on 128 nodes x 8 H100 with a few dead GPUs (target < 1 s),
   as shipped (ZeRO-1: the search sizes each packing's pipelines for its pipeline count)
   and without the distributed optimizer (one memory count for every packing), in
   turn in the same run.
2. Value: llama2-7b on 4 x 8 A100 with 0 to 8 dead GPUs (spread over the nodes, the
   usual case for single-GPU failures): predicted throughput, relative to the planner
   with every GPU alive, of (a) the planner, (b) the best uniform Megatron layout the
   alive GPUs can host, (c) the planner restricted to power-of-two TP groups. All
   three use the same cost model. Printed as a table and drawn into a PNG.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from elastor_mcore.planner import load_hardware, plan  # noqa: E402
from elastor_mcore.planner.baselines import best_uniform  # noqa: E402
from elastor_mcore.config.recipe import load_recipe  # noqa: E402

SPEED_DEAD = [0, 9, 100, 513, 1023]
VALUE_DEAD_ORDER = [0, 9, 18, 27, 1, 10, 19, 28]  # round-robin over the 4 nodes
POW2 = [1, 2, 4, 8]


def bench_speed(repeats: int) -> float:
    """The slower of the two variants' best CPU times."""
    shipped = load_recipe(REPO / "recipes/llama3-70b.yaml")
    plain = dataclasses.replace(shipped, training=dataclasses.replace(
        shipped.training, distributed_optimizer=False))
    hardware = load_hardware(REPO / "recipes/hardware/h100-80gb.yaml")
    alive = [g for g in range(128 * 8) if g not in SPEED_DEAD]
    slowest = 0.0
    for label, recipe in (("ZeRO-1 counted (as shipped)", shipped),
                          ("without the distributed optimizer", plain)):
        wall, cpu, result = [], [], None
        for _ in range(repeats):
            start, start_cpu = time.perf_counter(), time.process_time()
            result = plan(recipe, hardware, alive)
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        # The planner is single-threaded: its CPU time is its wall time on an idle core,
        # and does not grow when other jobs load a shared machine.
        print(f"speed: llama3-70b on 128 x 8 H100-80GB, {label}, dead {SPEED_DEAD}: "
              f"planned in {min(cpu):.3f} s CPU, {min(wall):.3f} s wall (best of "
              f"{repeats}; wall {', '.join(f'{t:.3f}' for t in wall)}) -> "
              f"{result.layout.num_gpus} GPUs in {len(result.layout.pipelines)} pipelines, "
              f"{result.step_s:.2f} s/step predicted "
              f"[{'OK' if min(cpu) < 1.0 else 'SLOWER THAN 1 s'}]")
        slowest = max(slowest, min(cpu))
    return slowest


def bench_value() -> list[dict]:
    recipe = load_recipe(REPO / "recipes/llama2-7b.yaml")
    hardware = load_hardware(REPO / "recipes/hardware/a100-80gb.yaml")
    full = plan(recipe, hardware, range(32)).step_s
    rows = []
    for n_dead in range(len(VALUE_DEAD_ORDER) + 1):
        dead = VALUE_DEAD_ORDER[:n_dead]
        alive = [g for g in range(32) if g not in dead]
        ours = plan(recipe, hardware, alive)
        uniform = best_uniform(recipe, hardware, alive)
        pow2 = plan(recipe, hardware, alive, tp_sizes=POW2)
        rows.append({"dead": n_dead, "alive": len(alive),
                     "planner": full / ours.step_s, "planner_gpus": ours.layout.num_gpus,
                     "uniform": full / uniform.step_s, "uniform_gpus": uniform.layout.num_gpus,
                     "uniform_layout": _shorthand(uniform),
                     "pow2": full / pow2.step_s, "pow2_gpus": pow2.layout.num_gpus})
    print(f"\nvalue: llama2-7b on 4 x 8 A100-80GB, throughput relative to all 32 GPUs alive "
          f"({full:.2f} s/step); dead GPUs in the order {VALUE_DEAD_ORDER}")
    sizes = [t for t in recipe.model.valid_tp_sizes if t <= 8]
    print(f"TP sizes the model allows within a node: {sizes}"
          + ("; all powers of two, so (c) can only equal (a) for this model"
             if all(t & (t - 1) == 0 for t in sizes) else ""))
    header = (f"{'dead':>4} {'alive':>5} | {'(a) planner':>16} | {'(b) best uniform':>30} | "
              f"{'(c) pow2 TP':>16}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['dead']:>4} {r['alive']:>5} | "
              f"{r['planner']:>7.1%} ({r['planner_gpus']:>2} GPUs) | "
              f"{r['uniform']:>7.1%} ({r['uniform_gpus']:>2} GPUs, {r['uniform_layout']:<11}) | "
              f"{r['pow2']:>7.1%} ({r['pow2_gpus']:>2} GPUs)")
    return rows


def _shorthand(result) -> str:
    pipe = result.layout.pipelines[0]
    return f"dp{len(result.layout.pipelines)}-tp{pipe.stages[0].tp}-pp{len(pipe.stages)}"


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib, or the 'plot' extra): "
              "skipping the PNG", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dead = [r["dead"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.plot(dead, [r["alive"] / 32 for r in rows], ":", color="grey", label="alive GPUs / 32")
    ax.plot(dead, [r["planner"] for r in rows], "o-", label="(a) planner")
    ax.plot(dead, [r["uniform"] for r in rows], "s-", label="(b) best uniform Megatron")
    ax.plot(dead, [r["pow2"] for r in rows], "x--", label="(c) planner, power-of-two TP")
    ax.set_xlabel("dead GPUs (of 32, spread over 4 nodes)")
    ax.set_ylabel("predicted throughput vs. all alive")
    ax.set_title("llama2-7b on 4 x 8 A100-80GB")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nplot written to {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--png", default="planner_value.png", help="where to draw the plot")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of the speed case")
    args = parser.parse_args()
    seconds = bench_speed(args.repeats)
    rows = bench_value()
    plot(rows, Path(args.png))
    return 0 if seconds < 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
