"""The demo's report: ``report.md`` (layouts with diagrams, those a recovery in place
chose inside a launch included, recovery timelines (in place and relaunch),
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


@dataclass(frozen=True)
class Segment:
    """One layout a run trained on: a launch's own, or one a recovery in place chose
    inside it (``epoch``)."""

    launch: LaunchRecord
    epoch: int
    describe: str
    slots: list[int]
    """Slots the layout uses."""
    alive: list[int]
    """Slots alive when it was planned."""
    predicted_step_s: float
    plan_s: float
    metrics: list[dict[str, Any]]
    """The steps it ran."""
    layout: dict[str, Any]
    """``Layout.to_dict`` (its ranks: the launch's slots, or the new world's ranks)."""

    @property
    def name(self) -> str:
        return (f"launch {self.launch.index}" if self.epoch == 0 else
                f"launch {self.launch.index}, in place {self.epoch}")

    @property
    def step_s(self) -> float | None:
        return measured_step_s([m["time_s"] for m in self.metrics])


def segments(launches: Sequence[LaunchRecord]) -> list[Segment]:
    """Every layout of every launch, in order; a launch's steps split at the steps its
    recoveries in place restored."""
    out = []
    for launch in launches:
        metrics = read_metrics(Path(launch.dir) / "metrics.jsonl")
        restored = {e["epoch"]: e["step"] for e in launch.events("restored")}
        plans = {e["epoch"]: e for e in launch.events("inplace_plan")}
        starts = [launch.resumed_from or 0] + [restored[e] for e in range(1, launch.epochs())]
        for epoch, start in enumerate(starts):
            end = starts[epoch + 1] if epoch + 1 < len(starts) else None
            ran = [m for m in metrics if m["step"] > start and (end is None or m["step"] <= end)]
            if epoch == 0:
                out.append(Segment(launch, 0, launch.describe, list(launch.slots),
                                   list(launch.alive), launch.predicted_step_s, launch.plan_s,
                                   ran, launch.layout))
                continue
            plan = plans[epoch]
            active = launch.current_slots() if epoch == launch.epochs() - 1 else None
            used = sorted(s for pipe in plan["layout"]["pipelines"] for stage in pipe["stages"]
                          for s in stage["ranks"])
            out.append(Segment(launch, epoch, plan["describe"],
                               active or [plan["slots"][r] for r in used],
                               list(plan["slots"]), plan["predicted_step_s"], plan["plan_s"],
                               ran, plan["layout"]))
    return out


def step_losses(launches: Sequence[LaunchRecord], reference: dict[int, float]) -> list[StepLoss]:
    """Every step every launch ran (redone steps included), against the reference."""
    return [StepLoss(m["step"], launch.index, m["loss"], reference[m["step"]])
            for launch in launches
            for m in read_metrics(Path(launch.dir) / "metrics.jsonl")]


def detections(items: Sequence[Recovery]) -> list[str]:
    """Markdown: how each failure was detected (which hang timeout applied), and the
    layout each recovery in place chose."""
    return [f"- {r.failure}: detected by {r.detected_by}"
            + (f"; {r.slots_before} -> {r.slots_after} slots on `{r.layout_after}`"
               if r.how == "in place" else "") for r in items]


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
    """Every rank of every layout that reported its memory (the worker's ``memory``
    event after each layout's first step: weights, gradients, optimizer state and peak
    saved activations), by slot (rank ``r`` of a layout runs on its ``r``-th slot)."""
    def total(parts: dict[str, float] | None) -> float | None:
        return None if parts is None else sum(v for k, v in parts.items() if k != "reserved")
    out = []
    for launch in launches:
        epochs = [launch.slots] + [e["slots"] for e in launch.events("inplace_plan")]
        for slots, event in zip(epochs, launch.events("memory")):
            out += [MeasuredMemory(launch.index, slots[r["rank"]], r["where"],
                                   total(r["measured"]), total(r["predicted"]))
                    for r in event["ranks"]]
    return out


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
    for i, segment in enumerate(segments(launches)):
        mine = [l for l in losses if l.launch == segment.launch.index
                and any(m["step"] == l.step for m in segment.metrics)]
        if mine:
            top.plot([l.step for l in mine], [l.loss for l in mine], "o", ms=4,
                     color=colors[i % len(colors)],
                     label=f"{segment.name}: {len(segment.slots)} slots")
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
           "Chosen by the planner for the slots alive at each launch, and inside a launch "
           "by the survivors of each recovery in place (slot ids are physical: node = "
           "slot // " f"{gpus_per_node}).", ""]
    layouts = segments(launches)
    for segment, diagram in zip(layouts, diagrams):
        steps = [m["step"] for m in segment.metrics]
        ran = f"steps {steps[0]}-{steps[-1]}" if steps else "no step"
        measured = segment.step_s
        timing = (f"step time: **{measured:.3f} s measured** (median of its steps after "
                  f"the first), **{segment.predicted_step_s:.3f} s predicted** by the "
                  f"planner ({measured / segment.predicted_step_s - 1:+.0%})"
                  if measured is not None else
                  f"step time: {segment.predicted_step_s:.3f} s predicted, none measured")
        how = ("planned by the supervisor" if segment.epoch == 0 else
               "planned by the survivors, in place")
        md += [f"### {segment.name.capitalize()}: {len(segment.slots)} slots, {ran}", "",
               f"`{segment.describe}` on slots {segment.slots} (alive: {segment.alive}); "
               f"{how} in {segment.plan_s * 1e3:.0f} ms", "", timing, "", "```", diagram,
               "```", ""]
    md += ["## Predicted and measured step times", "",
           "| when | slots | layout | predicted | measured (median) | error |",
           "|---|---|---|---|---|---|"]
    for segment in layouts:
        measured = segment.step_s
        cells = ((f"{measured:.3f} s", f"{measured / segment.predicted_step_s - 1:+.0%}")
                 if measured is not None else ("-", "-"))
        md.append(f"| {segment.name} | {len(segment.slots)} | `{segment.describe}` | "
                  f"{segment.predicted_step_s:.3f} s | {cells[0]} | {cells[1]} |")
    md += ["", "Measured on this machine while the run shared it; see "
           "`tools/check_planner.py` for interleaved comparisons.", ""]
    if slot_bytes is not None:
        md += ["## Memory per rank", ""] + memory_section(memory_of(launches), slot_bytes)
    md += ["## Recovery timeline", "",
           "Seconds per phase, from the failure to the first step on the new layout.", "",
           "In place (the survivors keep their processes): detect: failure injected → the "
           "first survivor's collective with the lost rank fails (a hang: after the "
           "supervisor killed the silent rank at its hang timeout); agree: → the "
           "survivors agreed on who is left and the planner chose their layout (its share "
           "in brackets); regroup: → every rank in a new process group with its stage "
           "built; restore: the state of the last step from the survivors' memory, peer to "
           "peer; first step: the first step on the new layout.", "",
           "Relaunch: detect: failure injected → supervisor notices; stop: kill the job; "
           "probe: find the survivors; plan: the planner; relaunch: start torchrun → every "
           "rank built and ready to load (processes, forked from the pre-imported worker "
           "unless --no-zygote; process groups, model); load: checkpoint load; first "
           "step: the first step after the load.", "", table(items), "",
           *detections(items), ""]
    md += ["## Checkpoints", "", "| launch | saves | blocked training, mean | max | "
           "load (slowest rank) |", "|---|---|---|---|---|"]
    for launch in launches:
        blocks = [m["save_block_s"] for m in read_metrics(Path(launch.dir) / "metrics.jsonl")
                  if m.get("save_block_s") is not None]
        ready = launch.events("ready", 0)
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
