"""``elastor profile``: measure the cost model's inputs for a recipe on this machine and
write them as a hardware profile (see ``docs/planner.md``)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from elastor_mcore.config.recipe import RecipeError, load_recipe
from elastor_mcore.config.shipped import shipped_path
from elastor_mcore.planner import HardwareError, load_hardware, write_hardware
from elastor_mcore.planner.calibration import DEFAULT_MAX_SPREAD, DEFAULT_REPEATS

CPU_BASE = shipped_path("hardware profile", "cpu-slots")
PREFIX = "elastor profile"


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "profile", help="measure layer, link and core-sharing costs for the planner",
        description="Time forward+backward of the recipe's stages (one transformer layer, "
                    "embedding, output layer) per TP degree with the runtime's mcore stages "
                    "in real TP groups (wall and CPU time), the optimizer step per "
                    "parameter, P2P and all-reduce inside a node, memory per layer and (CPU "
                    "slots) how many slots compute at once; write a hardware profile with "
                    "these tables that elastor plan, launch and demo use. Across nodes: "
                    "run python -m elastor_mcore.runtime.profile under a multi-node "
                    "torchrun launch (see docs/planner.md).")
    parser.add_argument("--recipe", required=True, help="recipe YAML (model + training)")
    parser.add_argument("--hardware", default=None,
                        help="profile to start from: memory, inter-node links and what is "
                             "not measured (default on CPU: recipes/hardware/cpu-slots.yaml; "
                             "required on CUDA)")
    parser.add_argument("--out", required=True, help="write the measured profile here (YAML)")
    parser.add_argument("--tp-sizes", default=None,
                        help="comma-separated TP degrees to measure (default: all the model "
                             "allows within a node); the world is twice the largest")
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                        help="timed repetitions per measurement, interleaved with the others "
                             "of its kind; the median is kept (default "
                             f"{DEFAULT_REPEATS})")
    parser.add_argument("--max-spread", type=float, default=DEFAULT_MAX_SPREAD,
                        help="refuse figures whose median's 90%% confidence interval is "
                             "wider than this fraction of the median after 3 attempts "
                             f"(default {DEFAULT_MAX_SPREAD})")
    parser.add_argument("--devices", choices=("auto", "cpu", "cuda"), default="auto",
                        help="measure CPU slots or CUDA devices (default: cuda if available)")
    parser.set_defaults(func=run)


def summary(profile, recipe) -> list[str]:
    tables = profile.measurements_for(recipe)
    lines = [f"{'TP':>3} {'layer ms':>9} {'stage ms':>9} {'embedding ms':>13} "
             f"{'output ms':>10} {'layer MiB (state + act.)':>25}"]
    for tp in tables.tp_sizes:
        fb = tables.forward_backward_ms[tp]
        mib = tables.state_mib[tp].layer + tables.activation_mib[tp].layer
        lines.append(f"{tp:>3} {fb.layer:9.3f} {fb.stage:9.3f} {fb.embedding:13.3f} "
                     f"{fb.output:10.3f} {mib:25.3f}")
    lines.append(f"links: all-reduce {profile.intra_node_latency_us:.0f} us + "
                 f"{profile.intra_node_bandwidth_gb_s:.2f} GB/s, P2P "
                 f"{profile.p2p_latency_us:.0f} us + {profile.p2p_bandwidth_gb_s:.2f} GB/s")
    if tables.optimizer_ns_per_param is not None:
        lines.append(f"optimizer step: {tables.optimizer_ns_per_param:.2f} ns per parameter")
    if profile.concurrency:
        lines.append("cores' worth of k slots busy at once: " + ", ".join(
            f"{k}: {worth:.2f}" for k, worth in sorted(profile.concurrency.items())))
    lines.append(f"worst spread of the stages' repetitions: "
                 f"{tables.measured_on['worst_stage_spread']:.0%}")
    return lines


def run(args: argparse.Namespace) -> int:
    from elastor_mcore.elastic.profiling import (ProfileError, default_tp_sizes, device_count,
                                                 measure)
    from elastor_mcore.cli.launch import devices

    try:
        recipe = load_recipe(args.recipe)
        device = devices(args.devices)
        if args.hardware is None and device == "cuda":
            raise ValueError("--hardware is required on CUDA: the datasheet profile of the "
                             "GPU (e.g. recipes/hardware/h100-80gb.yaml) supplies memory and "
                             "inter-node links")
        base_path = Path(args.hardware) if args.hardware else CPU_BASE
        base = load_hardware(base_path)
        if args.repeats < 3:
            raise ValueError(f"--repeats must be at least 3 (medians), got {args.repeats}")
        if not args.max_spread > 0:
            raise ValueError(f"--max-spread must be a positive fraction, got {args.max_spread}")
        allowed = default_tp_sizes(recipe, base, device_count() if device == "cuda" else None)
        tp_sizes = ([int(t) for t in args.tp_sizes.split(",")] if args.tp_sizes else allowed)
        bad = [t for t in tp_sizes if t not in allowed]
        if bad:
            raise ValueError(f"--tp-sizes {bad}: this recipe and machine allow {allowed} "
                             f"(divisors of heads, query groups and FFN width, at most the "
                             f"{base.gpus_per_node} GPUs of a node and, on CUDA, half the "
                             f"visible devices: two-stage pipelines are measured)")
    except (RecipeError, HardwareError, ValueError) as exc:
        print(f"{PREFIX}: {exc}", file=sys.stderr)
        return 2
    world = max(2, 2 * max(tp_sizes))
    print(f"{PREFIX}: {recipe.name} on {device}, TP {tp_sizes}, {world} ranks, "
          f"{args.repeats} repeats, starting from {base_path} ...", flush=True)
    start = time.perf_counter()
    try:
        profile = measure(args.recipe, recipe, base, tp_sizes, device, args.repeats,
                          on_line=lambda line: print(line, flush=True),
                          max_spread=args.max_spread)
    except ProfileError as exc:
        print(f"{PREFIX}: {exc}", file=sys.stderr)
        return 1
    write_hardware(profile, args.out,
                   f"Measured by: elastor profile --recipe {args.recipe} --hardware "
                   f"{base_path} --repeats {args.repeats} --max-spread {args.max_spread}"
                   f"\nNot measured (from {base_path}): "
                   f"memory, peak_tflops, efficiency_by_tp, inter-node links (measured only "
                   f"under a multi-node launch of elastor_mcore.runtime.profile).")
    print("\n".join(f"{PREFIX}:   {line}" for line in summary(profile, recipe)))
    print(f"{PREFIX}: wrote {args.out} in {time.perf_counter() - start:.0f}s", flush=True)
    return 0
