"""Check the planner's predictions against real training steps on this machine.

    PYTHONPATH=. python tools/check_planner.py [--hardware recipes/hardware/cpu-slots-measured.yaml]
                                               [--measure] [--runs 1] [--rounds 3] [--steps 5]
                                               [--out check_planner.json]

``--measure`` first runs ``elastor profile`` (TP 1 and 2, on top of ``cpu-slots``) and
checks against that profile, measured in the same run and so under the same load
(written beside ``--out`` as ``<out>.profile.yaml``); a profile whose repetitions
disagree beyond ``--max-spread`` is refused and that run reported as meaningless, with
the load average. ``--runs N`` does the whole (measure and) check N times, one after
the other (``<out>.runK.json``), and ends with a summary of every run: load average,
median error, Spearman, fastest layout predicted and measured.

Layouts of the tiny recipe, uniform and heterogeneous, on 1 to 4 slots of one node
(``LAYOUTS``, plus the planner's own best layout for 4 slots), are each trained for
``--steps`` steps per round in one 4-rank gloo world (each layout set up once with the
runtime's ``setup_stage``; ranks it does not use wait), round-robin for ``--rounds``
rounds, so that the machine's changing load (other jobs share it) falls on every
layout alike. Per layout: the planner's predicted step time under ``--hardware``
(``planner.predicted_step_s``) against the measured steps (the first step of each
round left out). Reported: each error, the median absolute error, the
Spearman rank correlation between predicted and measured order, whether the fastest
layout is the same, and the 1-minute load average before and after; all of it against
the median step (what the profile's medians stand for) and against the fastest step.
Per layout the JSON also carries the cost model's terms: critical path, the 1F1B fill
and drain, CPU work and contention. The figures go to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from elastor_mcore.config.recipe import load_recipe  # noqa: E402
from elastor_mcore.parallel.layout import Layout, layout_from_dict, load_layout  # noqa: E402
from elastor_mcore.planner import layout_cost, load_hardware, plan, predicted_step_s  # noqa: E402
from elastor_mcore.config.profile import DEFAULT_MAX_SPREAD, DEFAULT_REPEATS  # noqa: E402
from elastor_mcore.planner.cost_model import CostModel, pipelines_fill_s  # noqa: E402

TINY = ROOT / "recipes" / "tiny-llama.yaml"
WORLD = 4


def stages(*specs: tuple[int, int, list[int]]) -> list[dict]:
    return [{"tp": tp, "layers": layers, "ranks": ranks} for tp, layers, ranks in specs]


LAYOUTS: dict[str, object] = {
    "dp1-tp1-pp1": "dp1-tp1-pp1",
    "dp2-tp1-pp1": "dp2-tp1-pp1",
    "dp4-tp1-pp1": "dp4-tp1-pp1",
    "dp1-tp2-pp1": "dp1-tp2-pp1",
    "dp1-tp1-pp2": "dp1-tp1-pp2",
    "pp3 3|3|2": {"pipelines": [
        {"micro_batches": 16, "stages": stages((1, 3, [0]), (1, 3, [1]), (1, 2, [2]))}]},
    "dp2-tp2-pp1": "dp2-tp2-pp1",
    "hetero tp2|tp1 + tp1": {"pipelines": [
        {"micro_batches": 10, "stages": stages((2, 5, [0, 1]), (1, 3, [2]))},
        {"micro_batches": 6, "stages": stages((1, 8, [3]))}]},
    "hetero pp2 + pp1": {"pipelines": [
        {"micro_batches": 9, "stages": stages((1, 4, [0]), (1, 4, [1]))},
        {"micro_batches": 7, "stages": stages((1, 8, [2]))}]},
}
"""Name -> uniform shorthand or layout mapping (ranks 0..3 = slots of node 0)."""


def build_layouts(recipe, hardware) -> dict[str, Layout]:
    layouts = {name: (load_layout(spec, recipe) if isinstance(spec, str)
                      else layout_from_dict(spec)) for name, spec in LAYOUTS.items()}
    best = plan(recipe, hardware, range(WORLD)).layout
    if all(best.describe() != l.describe() for l in layouts.values()):
        layouts[f"planner's pick {best.describe()}"] = best
    for layout in layouts.values():
        layout.validate(recipe)
    return layouts


def run_ranks(args: argparse.Namespace) -> None:
    """Inside the torchrun world: train every layout round-robin, write step times."""
    import torch.distributed as dist

    from elastor_mcore.compat import cpu
    from elastor_mcore.data.samples import SyntheticTokens
    from elastor_mcore.parallel.groups import GroupCache, install
    from elastor_mcore.runtime.train import setup_stage, train_steps

    cpu.apply()
    dist.init_process_group("gloo")
    recipe = load_recipe(TINY)
    layouts = build_layouts(recipe, load_hardware(args.hardware))
    cache = GroupCache()
    runners = {name: setup_stage(recipe, layout, recipe.training.seed, cache)
               for name, layout in layouts.items()}
    source = SyntheticTokens(recipe.model.vocab_size, recipe.model.seq_length,
                             recipe.training.seed)
    times: dict[str, list[float]] = {name: [] for name in layouts}
    for round_ in range(args.rounds):
        for name, runner in runners.items():
            dist.barrier()
            if runner is None:
                continue
            install(runner.groups)  # mcore reads the TP view at call time
            steps = range(round_ * args.steps, (round_ + 1) * args.steps)
            metrics = train_steps(runner, source, steps)
            times[name] += [m.time_s for m in metrics[1:]]
        dist.barrier()
        if dist.get_rank() == 0:
            print(f"check_planner: round {round_ + 1}/{args.rounds} done", flush=True)
    gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, times)
    if dist.get_rank() == 0:
        merged = {name: max((g[name] for g in gathered), key=len) for name in layouts}
        Path(args.times).write_text(json.dumps(merged))
    dist.destroy_process_group()


def spearman(xs: list[float], ys: list[float]) -> float:
    """Rank correlation (average ranks for ties)."""
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return num / den if den else 0.0


def measure_profile(recipe, repeats: int, max_spread: float, out: Path) -> Path:
    """``elastor profile`` of the tiny recipe at TP 1 and 2, beside ``out``."""
    from elastor_mcore.config.profile import MeasureSettings
    from elastor_mcore.elastic.profiling import measure
    from elastor_mcore.planner import write_hardware

    base = ROOT / "recipes" / "hardware" / "cpu-slots.yaml"
    path = out.with_suffix(".profile.yaml")
    print(f"check_planner: measuring the profile (elastor profile, TP 1,2, {repeats} "
          f"repeats, load average {os.getloadavg()[0]:.1f}) ...", flush=True)
    settings = MeasureSettings(recipe=str(TINY), tp_sizes=(1, 2), repeats=repeats,
                               max_spread=max_spread)
    profile = measure(settings, recipe, load_hardware(base), "cpu", on_line=lambda line: None)
    write_hardware(profile, path, f"Measured by tools/check_planner.py --measure (elastor "
                                  f"profile --tp-sizes 1,2 --repeats {repeats} --max-spread "
                                  f"{max_spread} on {base}).")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hardware", default=str(ROOT / "recipes" / "hardware" /
                                                  "cpu-slots-measured.yaml"))
    parser.add_argument("--measure", action="store_true",
                        help="measure the profile first with elastor profile (same load)")
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                        help="elastor profile's repetitions with --measure")
    parser.add_argument("--max-spread", type=float, default=DEFAULT_MAX_SPREAD,
                        help="elastor profile's bound on its repetitions' spread (--measure)")
    parser.add_argument("--runs", type=int, default=1,
                        help="do the whole check this many times and summarise them")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="steps per layout and round")
    parser.add_argument("--out", default="check_planner.json")
    parser.add_argument("--times", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.times:
        run_ranks(args)
        return 0
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step of each round is left out)")
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if args.runs == 1:
        figures = check(args, Path(args.out), args.hardware)
        return 0 if figures and "refused" not in figures else 1
    out = Path(args.out)
    runs = []
    for run in range(1, args.runs + 1):
        print(f"\ncheck_planner: run {run}/{args.runs}", flush=True)
        runs.append(check(args, out.with_suffix(f".run{run}.json"), args.hardware))
    summary(runs)
    out.write_text(json.dumps(runs, indent=1))
    return 0 if all(r and "refused" not in r for r in runs) else 1


def summary(runs: list[dict | None]) -> None:
    """One line per run, then whether the goal (median error <= 25 %, the same fastest
    layout) held in every run."""
    print("\n| run | load average | median \\|error\\|, median step | fastest step | "
          "Spearman (median / fastest) | fastest layout, predicted / measured (median step) |"
          "\n| --- | --- | --- | --- | --- | --- |")
    for i, r in enumerate(runs, 1):
        if r is None:
            print(f"| {i} | | the training world failed | | | |")
            continue
        if "refused" in r:
            before, after = r["load_average_1min"]
            print(f"| {i} | {before:.1f} -> {after:.1f} | meaningless: the profile was refused "
                  f"(repetitions disagree beyond --max-spread) | | | |")
            continue
        m, f = r["median"], r["fastest"]
        print(f"| {i} | {r['load_average_1min'][0]:.1f} -> {r['load_average_1min'][1]:.1f} | "
              f"{m['median_abs_error']:.0%} | {f['median_abs_error']:.0%} | "
              f"{m['spearman']:.2f} / {f['spearman']:.2f} | `{m['best_predicted']}` / "
              f"`{m['best_measured']}` ({'same' if m['same_best'] else 'different'}) |")
    done = [r for r in runs if r and "refused" not in r]
    print(f"\n{len(done)} of {len(runs)} runs meaningful; median |error| <= 25 % in "
          f"{sum(r['median']['median_abs_error'] <= 0.25 for r in done)}, the same fastest "
          f"layout in {sum(r['median']['same_best'] for r in done)}; predicted fastest: "
          f"{sorted({r['median']['best_predicted'] for r in done})}")


def model_terms(recipe, hardware, layout: Layout) -> dict[str, float]:
    """The cost model's terms of ``layout`` (seconds per step): what a prediction is
    made of, to see which term a wrong one got wrong."""
    cost = CostModel(recipe, hardware)
    step = layout_cost(cost, layout, hardware.gpus_per_node)
    pipelines = [(p.micro_batches, [(s.tp, s.layers) for s in p.stages])
                 for p in layout.pipelines]
    return {"critical_s": max(p.time_s for p in step.pipelines) + step.grad_sync_s
            + step.optimizer_s,
            "fill_s": pipelines_fill_s((len(p.stages), p.bottleneck_s) for p in step.pipelines),
            "grad_sync_s": step.grad_sync_s, "optimizer_s": step.optimizer_s,
            "cpu_work_s": cost.pipelines_work(pipelines, step.grad_sync_s)[1],
            "contention": step.contention}


def check(args: argparse.Namespace, out: Path, hardware_path: str) -> dict | None:
    """One check (after measuring its profile with ``--measure``): its figures, also
    written to ``out``; ``{"refused": why, ...}`` if the profile was refused, None if
    the training world failed."""
    from elastor_mcore.elastic.profiling import UnstableProfile
    from elastor_mcore.elastic.torchrun import run_torchrun

    recipe = load_recipe(TINY)
    if args.measure:
        load = os.getloadavg()[0]
        try:
            hardware_path = str(measure_profile(recipe, args.repeats, args.max_spread, out))
        except UnstableProfile as exc:
            print(f"check_planner: this run is meaningless: {exc}", flush=True)
            figures = {"refused": str(exc), "load_average_1min": [load, os.getloadavg()[0]]}
            out.write_text(json.dumps(figures, indent=1))
            return figures
    hardware = load_hardware(hardware_path)
    layouts = build_layouts(recipe, hardware)
    predicted = {name: predicted_step_s(recipe, hardware, layout)
                 for name, layout in layouts.items()}
    terms = {name: model_terms(recipe, hardware, layout) for name, layout in layouts.items()}
    load_before = os.getloadavg()[0]
    print(f"check_planner: {len(layouts)} layouts x {args.rounds} rounds x {args.steps} steps "
          f"in a {WORLD}-rank world, profile {hardware_path}, load average "
          f"{load_before:.1f} ...", flush=True)
    times_path = out.with_suffix(".times.json")
    start = time.perf_counter()
    result = run_torchrun(WORLD, "tools.check_planner",
                          ["--hardware", hardware_path, "--rounds", str(args.rounds),
                           "--steps", str(args.steps), "--times", str(times_path)],
                          env={"PYTHONPATH": str(ROOT)})
    if result.returncode:
        print(f"check_planner: the training world failed (exit {result.returncode})",
              flush=True)
        return None
    times = json.loads(times_path.read_text())
    times_path.unlink()
    load_after = os.getloadavg()[0]
    names = list(layouts)
    figures = {"profile": hardware_path, "measured_profile": args.measure,
               "rounds": args.rounds, "steps": args.steps,
               "layouts": [{"layout": n, "describe": layouts[n].describe(),
                            "slots": layouts[n].num_gpus, "predicted_s": predicted[n],
                            "steps_timed": len(times[n]), **terms[n]} for n in names],
               "load_average_1min": [load_before, load_after], "cpus": os.cpu_count()}
    for statistic, reduce in (("median", statistics.median), ("fastest", min)):
        measured = {n: reduce(times[n]) for n in names}
        errors = {n: predicted[n] / measured[n] - 1 for n in names}
        for row in figures["layouts"]:
            row[f"measured_{statistic}_s"] = measured[row["layout"]]
            row[f"error_{statistic}"] = errors[row["layout"]]
        best_predicted = min(names, key=predicted.get)
        best_measured = min(names, key=measured.get)
        figures[statistic] = {
            "median_abs_error": statistics.median(abs(e) for e in errors.values()),
            "spearman": spearman([predicted[n] for n in names], [measured[n] for n in names]),
            "best_predicted": best_predicted, "best_measured": best_measured,
            "same_best": best_predicted == best_measured}
    figures["seconds"] = time.perf_counter() - start
    out.write_text(json.dumps(figures, indent=1))
    print("\n| layout | slots | predicted | measured median | error | measured fastest | error |"
          "\n|---|---|---|---|---|---|---|")
    for r in figures["layouts"]:
        print(f"| {r['layout']} `{r['describe']}` | {r['slots']} | {r['predicted_s']:.3f} s | "
              f"{r['measured_median_s']:.3f} s | {r['error_median']:+.0%} | "
              f"{r['measured_fastest_s']:.3f} s | {r['error_fastest']:+.0%} |")
    print()
    for statistic in ("median", "fastest"):
        f = figures[statistic]
        print(f"against the {statistic} step: median |error| {f['median_abs_error']:.0%}, "
              f"Spearman {f['spearman']:.2f}, fastest layout predicted "
              f"{f['best_predicted']!r}, measured {f['best_measured']!r} "
              f"({'same' if f['same_best'] else 'DIFFERENT'})")
    print(f"load average {load_before:.1f} -> {load_after:.1f} on {os.cpu_count()} CPUs, "
          f"{figures['seconds']:.0f}s; figures in {out}")
    return figures


if __name__ == "__main__":
    sys.exit(main())
