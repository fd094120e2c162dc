"""``elastor demo``: the main job. Train tiny-llama on 8 CPU slots (2 nodes x 4) under
the elastic supervisor, kill one slot and hang another, recover on 7 then 6 slots (in
place by default, ``--recovery relaunch`` for a relaunch from the last checkpoint), and
compare every step's loss with an uninterrupted run (see ``docs/elastic.md``).

The slots' memory (``DEFAULT_HARDWARE``) is too small for the model on TP-1 stages
alone once a node has lost a slot, so the planner gives some stages of a pipeline TP 2;
every launch measures its ranks' memory (``--report-memory``) and the demo checks it
against the slots'."""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

import yaml

from elastor_mcore.checkpoint.format import CheckpointError
from elastor_mcore.cli.launch import StepPrinter, print_summary
from elastor_mcore.cli.plan import diagram
from elastor_mcore.cli.stopping import report_stop, stopped_by
from elastor_mcore.config.failure_plan import Failure, FailurePlanError
from elastor_mcore.config.data import DataConfig
from elastor_mcore.config.launch import LaunchSettings
from elastor_mcore.config.recipe import RecipeError, load_recipe
from elastor_mcore.config.run import RunSettings
from elastor_mcore.config.shipped import shipped_path
from elastor_mcore.data.errors import DataError
from elastor_mcore.elastic.job import Trainer
from elastor_mcore.elastic.report import Segment, memory_of, read_metrics, segments, write_report
from elastor_mcore.elastic.supervisor import Supervisor, SupervisorConfig
from elastor_mcore.elastic.timeline import recoveries
from elastor_mcore.elastic.torchrun import run_torchrun
from elastor_mcore.planner import HardwareError, HardwareProfile, load_hardware, plan
from elastor_mcore.planner.cost_model import GIB

PREFIX = "elastor demo"
TOLERANCE = 1e-5
DEFAULT_HARDWARE = shipped_path("hardware profile", "cpu-slots-2.25mib")
REFERENCE_LAYOUT = "dp2-tp1-pp1"
"""Losses do not depend on the layout; two plain data-parallel ranks use both cores of a
small machine (each rank runs one BLAS thread) and halve the reference's time."""
CORPUS_MB = 4.0
"""Plenty for 40 steps of 16 x 32 tokens, and quick to tokenise on a small machine."""
OUTPUTS = ("checkpoints", "reference", "report.md", "loss.png", "timeline.json",
           "failure-plan.yaml")
"""What the demo writes into --out (and removes there before it starts); the corpus
and tokenizer in ``--out/data`` are kept and reused."""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo", help="the main job: elastic training through two failures, with a report",
        description="Train tiny-llama on 8 CPU slots (2 nodes x 4) under the elastic "
                    "supervisor with async saves, kill one slot and hang another, recover "
                    "on the survivors, run the same steps uninterrupted as the reference, "
                    "and write report.md, loss.png and timeline.json.")
    parser.add_argument("--out", default="runs/demo", help="output folder (default runs/demo)")
    RunSettings.add_arguments(parser, "demo", {
        "recipe": {"default": "tiny-llama"},
        "steps": {"default": 40, "help": "optimizer steps to run (default 40)"},
        "save_interval": {"default": 5, "help": "save every K steps (default 5)"}})
    parser.add_argument("--hardware", default=str(DEFAULT_HARDWARE),
                        help="the slots' hardware profile (default: CPU slots with 2.25 MiB "
                             "of memory for tensors each, too little for TP-1 stages alone "
                             "once a node has lost a slot)")
    parser.add_argument("--no-profile", action="store_true",
                        help="plan with --hardware as it is instead of measuring a profile "
                             "for the recipe on this machine (once per --out, cached in "
                             "--out/hardware-profile.yaml)")
    LaunchSettings.add_arguments(parser, "demo", {
        "slots": {"default": 8, "help": "CPU slots 0..N-1 (default %(default)s)"}})
    parser.add_argument("--kill", default="12:3", metavar="STEP:SLOT",
                        help="the slot killed and the step it dies at (default 12:3)")
    parser.add_argument("--hang", default="27:6", metavar="STEP:SLOT",
                        help="the slot that hangs and the step it hangs at (default 27:6)")
    parser.add_argument("--synthetic-data", action="store_true",
                        help="train on seeded random tokens instead of the demo corpus "
                             "(Python sources of this machine, made once under --out/data)")
    parser.set_defaults(func=run)


def parse_failure(spec: str, kind: str) -> Failure:
    try:
        step, slot = (int(x) for x in spec.split(":"))
    except ValueError:
        raise FailurePlanError(f"--{kind} {spec!r}: write STEP:SLOT, e.g. 12:3") from None
    return Failure(step=step, slot=slot, kind=kind)


def clean(out: Path) -> None:
    """Remove the demo's own outputs of an earlier run, nothing else."""
    for name in OUTPUTS:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    for path in out.glob("launch*"):
        if path.is_dir():
            shutil.rmtree(path)


def demo_data(args: argparse.Namespace, recipe, out: Path) -> DataConfig:
    """The demo corpus (made and tokenised the first time) or synthetic tokens."""
    if args.synthetic_data:
        return DataConfig(kind="synthetic")
    from elastor_mcore.data.prepare import prepare_data
    from elastor_mcore.data.stdlib_corpus import prepare_demo_data
    data = prepare_demo_data(out / "data", recipe, max_mb=CORPUS_MB)
    summary = prepare_data(data, recipe)
    print(f"{PREFIX}:   {summary.documents:,} documents, {summary.tokens:,} tokens",
          flush=True)
    return replace(data, fingerprint=summary.fingerprint)


class Stopped(Exception):
    """A stop signal ended the reference run."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def run_reference(settings: RunSettings, out: Path) -> float:
    """The uninterrupted run of ``settings`` on ``REFERENCE_LAYOUT``, without saves and
    without the in-memory tier (as ``elastor train``: nothing recovers it)."""
    out.mkdir(parents=True)
    start = time.perf_counter()
    reference = replace(settings, layout=REFERENCE_LAYOUT,
                        metrics_out=str(out / "metrics.jsonl"), failure_plan=None,
                        memory_interval=0)
    result = run_torchrun(2, Trainer.module, reference.to_argv("worker"), capture=True)
    (out / "torchrun.log").write_text(result.stdout + result.stderr)
    signum = stopped_by(result.returncode)
    if signum:
        raise Stopped(signum)
    if result.returncode:
        raise RuntimeError(f"the reference run failed (exit {result.returncode}); its output "
                           f"is in {out / 'torchrun.log'}")
    return time.perf_counter() - start


def layout_diagrams(config: SupervisorConfig, hardware, layouts: list[Segment]) -> list[str]:
    """``elastor plan``'s diagram of each layout (the planner is deterministic, so
    planning its alive slots again with the supervisor's profile gives the layout, in
    place or not)."""
    recipe, use_all = config.recipe, config.launch.use_all_slots
    full = plan(recipe, hardware, config.slots, use_all=use_all)
    tokens = recipe.training.global_batch_size * recipe.model.seq_length
    out = []
    for segment in layouts:
        chosen = plan(recipe, hardware, segment.alive, use_all=use_all)
        dead = [s for s in config.slots if s not in segment.alive]
        out.append(diagram(chosen, full.step_s, tokens,
                           f"{recipe.name} on {len(segment.alive)} alive slots (dead: "
                           f"{', '.join(map(str, dead)) or 'none'})"))
    return out


def slot_bytes(hardware: HardwareProfile) -> float:
    """What one slot holds for tensors: its memory less the reserve."""
    return (hardware.memory_per_gpu_gib - hardware.memory_reserved_gib) * GIB


def mixed_tp(layout: dict) -> list[str]:
    """The pipelines of ``layout`` (``Layout.to_dict``) whose stages differ in TP, as
    ``P1: TP 2, 1``."""
    out = []
    for p, pipe in enumerate(layout["pipelines"]):
        tps = [stage["tp"] for stage in pipe["stages"]]
        if len(set(tps)) > 1:
            out.append(f"P{p}: TP {', '.join(map(str, tps))}")
    return out


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    try:
        recipe = load_recipe(args.recipe)
        hardware = load_hardware(args.hardware)
        failures = (parse_failure(args.kill, "kill"), parse_failure(args.hang, "hang"))
        settings = replace(RunSettings.from_args(args, "demo"),
                           failure_plan=str(out / "failure-plan.yaml"), report_memory=True)
        launch = LaunchSettings.from_args(
            args, "demo", hardware=args.hardware, run_dir=str(out),
            max_restarts=len(failures), devices="cpu", measure_profile=not args.no_profile,
            use_all_slots=True)
        config = SupervisorConfig(workload=Trainer(settings), launch=launch, recipe=recipe,
                                  failures=failures, hardware=hardware,
                                  slots=tuple(range(launch.slots)))
    except (RecipeError, HardwareError, FailurePlanError, ValueError) as exc:
        print(f"{PREFIX}: {exc}", file=sys.stderr)
        return 2
    nodes = -(-args.slots // hardware.gpus_per_node)
    print(f"{PREFIX}: {recipe.name} on {args.slots} CPU slots ({nodes} nodes x "
          f"{hardware.gpus_per_node}), {args.steps} steps, async save every "
          f"{args.save_interval}; failures: " + ", ".join(
              f"{f.kind} slot {f.slot} at step {f.step}" for f in failures), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    clean(out)
    (out / "failure-plan.yaml").write_text(yaml.safe_dump(
        {"failures": [{"step": f.step, "slot": f.slot, "kind": f.kind} for f in failures]},
        sort_keys=False))

    print(f"{PREFIX}: [1/4] data: " + ("synthetic tokens" if args.synthetic_data else
                                       f"the demo corpus under {out / 'data'}"), flush=True)
    try:
        data = demo_data(args, recipe, out)
    except DataError as exc:
        print(f"{PREFIX}: {exc}", file=sys.stderr)
        return 2
    settings = replace(settings, data=data)
    config = replace(config, workload=Trainer(settings))

    print(f"{PREFIX}: [2/4] reference: {args.steps} uninterrupted steps on "
          f"{REFERENCE_LAYOUT} ...", flush=True)
    try:
        took = run_reference(settings, out / "reference")
    except Stopped as stop:
        return report_stop(PREFIX, stop.signum, None)
    except RuntimeError as exc:
        print(f"{PREFIX}: {exc}", file=sys.stderr)
        return 1
    reference = {m["step"]: m["loss"] for m in read_metrics(out / "reference" / "metrics.jsonl")}
    print(f"{PREFIX}:   done in {took:.0f}s, final loss {reference[args.steps]:.6f}", flush=True)

    print(f"{PREFIX}: [3/4] elastic run under the supervisor ...", flush=True)
    start = time.perf_counter()
    supervisor = Supervisor(config, on_message=lambda line: print(f"{PREFIX}:   {line}",
                                                                  flush=True),
                            on_step=StepPrinter(args.steps, every=5, prefix=PREFIX))
    try:
        outcome = supervisor.run()
    except CheckpointError as exc:  # another job holds the checkpoint root
        print(f"{PREFIX}: {exc}", file=sys.stderr)
        return 2
    if outcome.stopped_by:
        return report_stop(PREFIX, outcome.stopped_by, config.checkpoint_dir)
    elastic_s = time.perf_counter() - start

    print(f"{PREFIX}: [4/4] report ...", flush=True)
    items = recoveries(outcome.launches)
    layouts = segments(outcome.launches)
    summary = (f"{'Finished' if outcome.finished else 'FAILED'}: {outcome.reason}. "
               f"Slots per layout: {' -> '.join(str(len(l.slots)) for l in layouts)} "
               f"({len(outcome.launches)} launch{'es' if len(outcome.launches) > 1 else ''}); "
               f"elastic run {elastic_s:.0f}s, reference {took:.0f}s.")
    capacity = slot_bytes(supervisor.hardware)
    settings = {"recipe": args.recipe,
                "hardware": f"{args.hardware} ({capacity / 2**20:.2f} MiB per slot for "
                            f"tensors)",
                "planner profile": f"{supervisor.profile_path} (every alive slot kept busy: "
                                   f"the slots stand for GPUs)",
                "slots": f"{args.slots} ({nodes} nodes x {hardware.gpus_per_node})",
                "steps": args.steps, "saves": f"asynchronous, every {args.save_interval} steps",
                "failures": ", ".join(f"{f.kind} of slot {f.slot} at step {f.step}"
                                      for f in failures),
                "recovery": (f"in place from the state in memory (every "
                             f"{args.memory_interval} step(s), a replica on another node), "
                             f"a relaunch if that fails" if args.recovery == "in-place" else
                             "relaunch from the last checkpoint")
                            + (", ranks forked from a pre-imported worker" if args.zygote
                               else ", ranks started cold"),
                "hang timeout": f"3 x the p99 of each rank's step times, at least "
                                f"{args.heartbeat_timeout:g}s, once it has timed 3 steps of "
                                f"its launch; {args.startup_timeout:g}s before, during saves "
                                f"and after the last step (each hang's in the recovery "
                                f"timeline)",
                "data": data.describe() + " (samples are the same under every layout)",
                "reference": f"the same steps uninterrupted on {REFERENCE_LAYOUT} (2 "
                             f"data-parallel ranks, no failure)"}
    worst = write_report(out, "elastor demo: recovery on the survivors",
                         "elastor demo " + " ".join(sys.argv[2:]), settings, outcome.launches,
                         reference, layout_diagrams(config, supervisor.hardware, layouts),
                         hardware.gpus_per_node, summary, slot_bytes=capacity)
    print_summary(outcome, PREFIX)
    for segment in layouts:
        mixed = mixed_tp(segment.layout)
        print(f"{PREFIX}:   {segment.name}: {len(segment.slots):2d} slots  "
              f"{segment.describe}" + (f"  (per-stage TP: {'; '.join(mixed)})" if mixed else ""))
    memory = memory_of(outcome.launches)
    fullest = max((m.measured for m in memory), default=None)
    fits = fullest is not None and fullest <= capacity
    if fullest is None:
        print(f"{PREFIX}: memory: no launch reported its ranks' memory")
    else:
        print(f"{PREFIX}: memory: fullest rank {fullest / 2**20:.3f} MiB measured, the slots "
              f"hold {capacity / 2**20:.2f} MiB ({'within' if fits else 'ABOVE'})")
    ok = (outcome.finished and len(items) == len(failures) and worst <= TOLERANCE
          and fits)
    print(f"{PREFIX}: max relative loss difference from the reference over every step run: "
          f"{worst:.2e} ({'within' if worst <= TOLERANCE else 'ABOVE'} {TOLERANCE:g})")
    print(f"{PREFIX}: wrote {out / 'report.md'}, {out / 'loss.png'}, {out / 'timeline.json'}")
    return 0 if ok else 1
