"""``elastor plan``: the fastest layout for a cluster with some GPUs dead."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from elastor_mcore.config.shipped import HARDWARE_HELP, RECIPE_HELP
from elastor_mcore.parallel.layout import Layout
from elastor_mcore.planner import HardwareError, Plan, PlannerError, load_hardware, plan
from elastor_mcore.planner.cost_model import GIB
from elastor_mcore.config.recipe import RecipeError, load_recipe


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan", help="plan the fastest layout for the alive GPUs",
        description="Search pipelines, stages, TP groups, layer and micro-batch splits for "
                    "the GPUs that are alive, under an analytic cost model, and print the "
                    "layout (ranks are physical GPU ids: node * gpus_per_node + local id).")
    parser.add_argument("--recipe", required=True, help=RECIPE_HELP)
    parser.add_argument("--hardware", required=True, help=HARDWARE_HELP)
    parser.add_argument("--nodes", type=int, required=True, help="nodes in the cluster")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="GPUs per node (default: the hardware profile's)")
    parser.add_argument("--dead", default="",
                        help="comma-separated physical ids of dead GPUs, e.g. 0,9")
    parser.add_argument("--tp-sizes", default=None,
                        help="comma-separated TP degrees to consider (default: all the model "
                             "allows within a node)")
    parser.add_argument("--out", default=None, help="write the layout YAML here")
    parser.add_argument("--json", action="store_true",
                        help="print a JSON report instead of the diagram")
    parser.set_defaults(func=run)


def _int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None


def _ranges(ids: tuple[int, ...]) -> str:
    """``0,1,2,3,8`` -> ``0-3,8``."""
    out, start = [], None
    for i, g in enumerate(ids):
        if start is None:
            start = g
        if i + 1 == len(ids) or ids[i + 1] != g + 1:
            out.append(str(start) if start == g else f"{start}-{g}")
            start = None
    return ",".join(out)


def _shape(layout: Layout, p: int) -> tuple:
    pipe = layout.pipelines[p]
    return pipe.micro_batches, tuple((s.tp, s.layers) for s in pipe.stages)


def _memory(nbytes: float) -> str:
    """A stage's memory per GPU: GiB, or MiB below one GiB (small models, CPU slots)."""
    return f"{nbytes / GIB:6.1f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:6.1f} MiB"


def diagram(result: Plan, full_step_s: float, tokens_per_step: int, title: str) -> str:
    """Pipelines x stages, identical consecutive pipelines folded into one block."""
    layout, lines = result.layout, [title, ""]
    p = 0
    while p < len(layout.pipelines):
        q = p
        while q + 1 < len(layout.pipelines) and _shape(layout, q + 1) == _shape(layout, p):
            q += 1
        pipe, pcost = layout.pipelines[p], result.cost.pipelines[p]
        label = f"pipeline {p}" if p == q else f"pipelines {p}-{q} ({q - p + 1} alike, first shown)"
        stages = f"{len(pipe.stages)} stage" + ("s" if len(pipe.stages) > 1 else "")
        lines.append(f"{label}: {pipe.micro_batches} micro-batches, {stages}, "
                     f"{len(pipe.ranks)} GPUs, {pcost.time_s:.2f} s")
        for s, (stage, scost) in enumerate(zip(pipe.stages, pcost.stages)):
            layers = layout.layer_range(p, s)
            lines.append(
                f"  stage {s}  tp{stage.tp:<2} layers {layers.start:>3}-{layers.stop - 1:<3} "
                f"({stage.layers:>3})  {scost.time_s * 1e3:8.1f} ms/micro-batch  "
                f"{_memory(scost.memory.total)} (optimizer {_memory(scost.memory.optimizer)})"
                f"  GPUs {_ranges(stage.ranks)}")
        p = q + 1
    step = result.cost
    parts = (f"slowest pipeline {max(pc.time_s for pc in step.pipelines):.3f} s + gradient "
             f"sync {step.grad_sync_s:.3f} s + optimizer {step.optimizer_s:.3f} s")
    if step.contention > 1:
        parts = (f"({parts}) x {step.contention:.2f}: the {result.layout.num_gpus} slots' CPU "
                 f"work exceeds what the shared cores do in that time")
    lines += [
        "",
        f"idle GPUs: {_ranges(result.idle_gpus) or 'none'}",
        f"predicted step time: {step.step_s:.3f} s ({parts}), "
        f"{tokens_per_step / step.step_s:,.0f} tokens/s",
        f"throughput: {full_step_s / step.step_s:.1%} of all GPUs alive "
        f"({full_step_s:.3f} s/step)",
    ]
    return "\n".join(lines)


def assumptions(recipe, pipelines: int) -> str:
    """What the cost model assumed of the recipe's training settings (the runtime runs
    the same: ``training.sequence_parallel``, ``training.recompute_*``,
    ``training.distributed_optimizer``) for a layout of ``pipelines`` pipelines."""
    t = recipe.training
    recompute = (f"full ({t.recompute_method}, {t.recompute_num_layers} layer(s))"
                 if t.recompute_granularity == "full" else t.recompute_granularity or "none")
    optimizer = (f"on (training.distributed_optimizer: each weight's optimizer state split "
                 f"over the {pipelines} pipeline(s) holding it, a norm's over every rank "
                 f"holding it)" if t.distributed_optimizer else
                 "off (training.distributed_optimizer: every rank holds the optimizer state "
                 "of all its weights)")
    return (f"assumed: sequence parallelism {'on' if t.sequence_parallel else 'off'} "
            f"(training.sequence_parallel), activation recomputation {recompute} "
            f"(training.recompute_granularity), distributed optimizer {optimizer}")


def run(args: argparse.Namespace) -> int:
    try:
        recipe = load_recipe(args.recipe)
        hardware = load_hardware(args.hardware)
        gpn = args.gpus_per_node or hardware.gpus_per_node
        if args.nodes <= 0 or gpn <= 0:
            raise ValueError("--nodes and --gpus-per-node must be positive")
        total = args.nodes * gpn
        dead = sorted(set(_int_list(args.dead, "--dead")))
        bad = [g for g in dead if not 0 <= g < total]
        if bad:
            raise ValueError(f"--dead: GPU ids {bad} are outside 0..{total - 1} "
                             f"({args.nodes} nodes x {gpn} GPUs)")
        tp_sizes = _int_list(args.tp_sizes, "--tp-sizes") if args.tp_sizes else None
        alive = [g for g in range(total) if g not in set(dead)]
        result = plan(recipe, hardware, alive, gpus_per_node=gpn, tp_sizes=tp_sizes)
        full = result if not dead else plan(recipe, hardware, range(total), gpus_per_node=gpn,
                                            tp_sizes=tp_sizes)
    except (RecipeError, HardwareError, PlannerError, ValueError) as exc:
        print(f"elastor plan: {exc}", file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).write_text(result.layout.to_yaml())
    tokens = recipe.training.global_batch_size * recipe.model.seq_length
    if args.json:
        report = {"recipe": recipe.name, "hardware": hardware.name, "nodes": args.nodes,
                  "gpus_per_node": gpn, "dead": dead, **result.to_dict(),
                  "tokens_per_s": tokens / result.step_s,
                  "all_alive_step_s": full.step_s,
                  "relative_throughput": full.step_s / result.step_s,
                  "sequence_parallel": recipe.training.sequence_parallel,
                  "distributed_optimizer": recipe.training.distributed_optimizer,
                  "recompute_granularity": recipe.training.recompute_granularity}
        print(json.dumps(report, indent=2))
    else:
        title = (f"{recipe.name} on {args.nodes} x {gpn} GPUs ({hardware.name}), dead: "
                 f"{', '.join(map(str, dead)) or 'none'}; {len(alive)} alive, "
                 f"{result.layout.num_gpus} used")
        print(diagram(result, full.step_s, tokens, title))
        print(assumptions(recipe, len(result.layout.pipelines)))
        if args.out:
            print(f"layout written to {args.out}")
    return 0
