"""``elastor profile``: measure the cost model's inputs for a recipe on this machine and
write them as a hardware profile (see ``docs/planner.md``)."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

from elastor_mcore.config.profile import MeasureSettings
from elastor_mcore.config.recipe import RecipeError, load_recipe
from elastor_mcore.config.shipped import shipped_path
from elastor_mcore.planner import HardwareError, load_hardware, write_hardware

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
                    "run python -m elastor_mcore.elastic.rank.measure under a "
                    "multi-node torchrun launch (see docs/planner.md).")
    MeasureSettings.add_arguments(parser, "profile")
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
        settings = MeasureSettings.from_args(args, "profile")
        settings.check()
        recipe = load_recipe(settings.recipe)
        device = devices(settings.devices)
        if settings.hardware is None and device == "cuda":
            raise ValueError("--hardware is required on CUDA: the datasheet profile of the "
                             "GPU (e.g. recipes/hardware/h100-80gb.yaml) supplies memory and "
                             "inter-node links")
        base_path = Path(settings.hardware) if settings.hardware else CPU_BASE
        base = load_hardware(base_path)
        allowed = default_tp_sizes(recipe, base, device_count() if device == "cuda" else None)
        tp_sizes = list(settings.tp_sizes or allowed)
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
          f"{settings.repeats} repeats, starting from {base_path} ...", flush=True)
    start = time.perf_counter()
    try:
        profile = measure(replace(settings, tp_sizes=tuple(tp_sizes)), recipe, base, device,
                          on_line=lambda line: print(line, flush=True))
    except ProfileError as exc:
        print(f"{PREFIX}: {exc}", file=sys.stderr)
        return 1
    write_hardware(profile, settings.out,
                   f"Measured by: elastor profile --recipe {settings.recipe} --hardware "
                   f"{base_path} --repeats {settings.repeats} --max-spread "
                   f"{settings.max_spread}"
                   f"\nNot measured (from {base_path}): "
                   f"memory, peak_tflops, efficiency_by_tp, inter-node links (measured only "
                   f"under a multi-node launch of elastor_mcore.elastic.rank.measure).")
    print("\n".join(f"{PREFIX}:   {line}" for line in summary(profile, recipe)))
    print(f"{PREFIX}: wrote {settings.out} in {time.perf_counter() - start:.0f}s", flush=True)
    return 0
