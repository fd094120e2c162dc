"""The demo's report: ``report.md`` (layouts with diagrams, recovery timeline,
checkpoint save and load times, each rank's measured memory against the slots',
per-step loss against the reference) and ``loss.png``.

Inputs are the supervisor's ``LaunchRecord``s with each launch's metrics and events
(the ``memory`` event of a launch run with ``--report-memory``), the reference run's
losses, and a diagram per layout (``elastor plan``'s renderer).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from elastor_mcore.elastic.timeline import LaunchRecord, Recovery, recoveries, table
from elastor_mcore.planner import measured_step_s


@dataclass(frozen=True)
class StepLoss:
    step: int
    launch: int
    loss: float
    reference: float

    @property
    def relative_difference(self) -> float:
        return abs(self.loss - self.reference) / abs(self.reference)


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def launch_step_s(launch: LaunchRecord) -> float | None:
    """The launch's measured step time (``planner.measured_step_s`` of its steps)."""
    return measured_step_s([m["time_s"] for m in read_metrics(Path(launch.dir) /
                                                             "metrics.jsonl")])


def step_losses(launches: Sequence[LaunchRecord], reference: dict[int, float]) -> list[StepLoss]:
    """Every step every launch ran (redone steps included), against the reference."""
    return [StepLoss(m["step"], launch.index, m["loss"], reference[m["step"]])
            for launch in launches
            for m in read_metrics(Path(launch.dir) / "metrics.jsonl")]


@dataclass(frozen=True)
class MeasuredMemory:
    """One rank's training tensors after a launch's first step, as ``--report-memory``
    measured them (bytes), beside the planner's prediction for its stage."""

    launch: int
    slot: int
    where: str
    measured: float
    predicted: float | None


def memory_of(launches: Sequence[LaunchRecord]) -> list[MeasuredMemory]:
    """Every rank of every launch that reported its memory (the worker's ``memory``
    event: weights, gradients, optimizer state and peak saved activations), by slot
    (torchrun rank ``r`` of a launch runs on its ``r``-th slot)."""
    def total(parts: dict[str, float] | None) -> float | None:
        return None if parts is None else sum(v for k, v in parts.items() if k != "reserved")
    return [MeasuredMemory(launch.index, launch.slots[r["rank"]], r["where"],
                           total(r["measured"]), total(r["predicted"]))
            for launch in launches for event in launch.events("memory")[:1]
            for r in event["ranks"]]


def memory_section(memory: Sequence[MeasuredMemory], slot_bytes: float) -> list[str]:
    """Markdown: every rank's measured memory against the slot's and the planner's."""
    mib = 2**20
    if not memory:
        return ["No launch reported its memory (run with --report-memory).", ""]
    worst = max(memory, key=lambda m: m.measured)
    md = [f"Each slot holds **{slot_bytes / mib:.2f} MiB** of training tensors (the "
          f"hardware profile's memory less its reserve). Measured by `--report-memory` "
          f"after each launch's first step: weights, gradients, optimizer state and the "
          f"peak of the activations saved for backward. Fullest rank: "
          f"**{worst.measured / mib:.3f} MiB** ({worst.measured / slot_bytes:.0%} of the "
          f"slot), launch {worst.launch} {worst.where} (slot {worst.slot}).", "",
          "| launch | slot | stage | measured | planner | of the slot |",
          "|---|---|---|---|---|---|"]
    md += [f"| {m.launch} | {m.slot} | {m.where} | {m.measured / mib:.3f} MiB | "
           + (f"{m.predicted / mib:.3f} MiB" if m.predicted is not None else "-")
           + f" | {m.measured / slot_bytes:.0%} |" for m in memory]
    return md + [""]


def plot_losses(path: str | os.PathLike, reference: dict[int, float],
                losses: Sequence[StepLoss], launches: Sequence[LaunchRecord],
                items: Sequence[Recovery]) -> None:
    """Both loss curves, the failures and the resumed steps marked; below, the
    relative difference per step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1.3]})
    steps = sorted(reference)
    top.plot(steps, [reference[s] for s in steps], color="black", lw=1.2,
             label="reference (uninterrupted)")
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown"]
    for launch in launches:
        mine = [l for l in losses if l.launch == launch.index]
        if mine:
            top.plot([l.step for l in mine], [l.loss for l in mine], "o", ms=4,
                     color=colors[launch.index % len(colors)],
                     label=f"launch {launch.index}: {len(launch.slots)} slots")
    for r in items:
        if r.failed_at_step is not None:
            for ax in (top, bottom):
                ax.axvline(r.failed_at_step - 0.5, color="red", ls="--", lw=1)
            top.annotate(r.failure, (r.failed_at_step - 0.5, 1.0), xycoords=("data", "axes fraction"),
                         rotation=90, va="top", ha="right", fontsize=8, color="red")
        if r.resumed_from is not None:
            for ax in (top, bottom):
                ax.axvline(r.resumed_from + 0.5, color="gray", ls=":", lw=1)
            top.annotate(f"resume from step {r.resumed_from}",
                         (r.resumed_from + 0.5, 0.0), xycoords=("data", "axes fraction"),
                         rotation=90, va="bottom", ha="left", fontsize=8, color="gray")
    top.set_ylabel("loss")
    top.set_title("tiny-llama: elastic run with failures vs. uninterrupted reference")
    top.legend(fontsize=8, loc="upper right")
    diffs = [max(l.relative_difference, 1e-12) for l in losses]
    bottom.semilogy([l.step for l in losses], diffs, ".", color="tab:blue")
    bottom.axhline(1e-5, color="red", lw=0.8, label="1e-5")
    bottom.set_ylabel("|Δloss| / loss\n(0 drawn at 1e-12)")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(out: str | os.PathLike, title: str, command: str,
                 settings: dict[str, Any], launches: Sequence[LaunchRecord],
                 reference: dict[int, float], diagrams: Sequence[str],
                 gpus_per_node: int, summary: str, slot_bytes: float | None = None) -> float:
    """Write ``report.md`` and ``loss.png`` into ``out``; returns the largest relative
    loss difference from the reference over every step run. With ``slot_bytes`` (a
    slot's memory for tensors), a section holds each rank's measured memory against it."""
    out = Path(out)
    items = recoveries(launches)
    losses = step_losses(launches, reference)
    worst = max((l.relative_difference for l in losses), default=float("nan"))
    plot_losses(out / "loss.png", reference, losses, launches, items)
    md = [f"# {title}", "", f"`{command}`", "", summary, "", "## Settings", ""]
    md += [f"- {k}: {v}" for k, v in settings.items()]
    md += ["", "## Layouts", "",
           "Chosen by the planner for the slots alive at each launch (slot ids are "
           "physical: node = slot // " f"{gpus_per_node}).", ""]
    dead: list[int] = []
    for launch, diagram in zip(launches, diagrams):
        steps = [m["step"] for m in read_metrics(Path(launch.dir) / "metrics.jsonl")]
        ran = f"steps {steps[0]}-{steps[-1]}" if steps else "no step"
        measured = launch_step_s(launch)
        timing = (f"step time: **{measured:.3f} s measured** (median of its steps after "
                  f"the first), **{launch.predicted_step_s:.3f} s predicted** by the "
                  f"planner ({measured / launch.predicted_step_s - 1:+.0%})"
                  if measured is not None else
                  f"step time: {launch.predicted_step_s:.3f} s predicted, none measured")
        md += [f"### Launch {launch.index}: {len(launch.slots)} slots, {ran}, "
               f"{launch.outcome}", "",
               f"`{launch.describe}` on slots {launch.slots}; dead slots: "
               f"{', '.join(map(str, dead)) or 'none'}; planned in "
               f"{launch.plan_s * 1e3:.0f} ms", "", timing, "", "```", diagram, "```", ""]
        dead += [e["slot"] for e in launch.failures()]
    md += ["## Predicted and measured step times", "",
           "| launch | slots | layout | predicted | measured (median) | error |",
           "|---|---|---|---|---|---|"]
    for launch in launches:
        measured = launch_step_s(launch)
        cells = ((f"{measured:.3f} s", f"{measured / launch.predicted_step_s - 1:+.0%}")
                 if measured is not None else ("-", "-"))
        md.append(f"| {launch.index} | {len(launch.slots)} | `{launch.describe}` | "
                  f"{launch.predicted_step_s:.3f} s | {cells[0]} | {cells[1]} |")
    md += ["", "Measured on this machine while the run shared it; see "
           "`tools/check_planner.py` for interleaved comparisons.", ""]
    if slot_bytes is not None:
        md += ["## Memory per rank", ""] + memory_section(memory_of(launches), slot_bytes)
    md += ["## Recovery timeline", "",
           "Seconds per phase, from the failure to the first step on the new layout. "
           "detect: failure injected → supervisor notices; stop: kill the job; probe: find "
           "the survivors; plan: the planner; relaunch: start torchrun → every rank built "
           "and ready to load (imports, process groups, model); load: checkpoint load; "
           "first step: the first step after the load.", "", table(items), ""]
    md += [f"- {r.failure}: detected by {r.detected_by}" for r in items] + [""]
    md += ["## Checkpoints", "", "| launch | saves | blocked training, mean | max | "
           "load (slowest rank) |", "|---|---|---|---|---|"]
    for launch in launches:
        blocks = [m["save_block_s"] for m in read_metrics(Path(launch.dir) / "metrics.jsonl")
                  if m.get("save_block_s") is not None]
        ready = launch.events("ready")
        load = (f"{max(e['load_s'] for e in ready):.2f}s (step {launch.resumed_from})"
                if ready and launch.resumed_from is not None else "- (from scratch)")
        mean = f"{sum(blocks) / len(blocks):.3f}s" if blocks else "-"
        peak = f"{max(blocks):.3f}s" if blocks else "-"
        md.append(f"| {launch.index} | {len(blocks)} | {mean} | {peak} | {load} |")
    md += ["", "Saves are asynchronous: training blocks only for the copy into host "
           "buffers; the write and the commit run in the background.", "",
           "## Loss against the uninterrupted reference", "",
           f"Largest relative difference over all {len(losses)} steps run (redone steps "
           f"included): **{worst:.2e}** (contract: ≤ 1e-5).", "", "![loss](loss.png)", "",
           "| step | launch | loss | reference | relative difference |", "|---|---|---|---|---|"]
    md += [f"| {l.step} | {l.launch} | {l.loss:.7f} | {l.reference:.7f} | "
           f"{l.relative_difference:.2e} |" for l in losses]
    (out / "report.md").write_text("\n".join(md) + "\n")
    return worst
