"""What happened when: one record per launch, and per failure the phases of recovery.

The supervisor times what it does (detect, stop, probe, plan, relaunch); ranks time
what only they see (the checkpoint load, the first step after it, the failure itself,
a recovery in place) in the launch's event log. ``recoveries`` joins the two on
wall-clock time (one machine, one clock). The phases of a recovery add up to its
total. A relaunch:

    failure -> detect -> stop -> probe -> plan -> relaunch -> load -> first step

A recovery in place (``elastic/rank/inplace.py``), inside one launch:

    failure -> detect -> agree (and plan) -> regroup -> restore -> first step
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from elastor_mcore.elastic.protocol import EVENTS_FILE, read_events

PHASES = ("detect_s", "stop_s", "probe_s", "plan_s", "relaunch_s", "load_s", "first_step_s")
IN_PLACE_PHASES = ("detect_s", "agree_s", "regroup_s", "load_s", "first_step_s")


@dataclass
class LaunchRecord:
    """One torchrun launch on one layout, as the supervisor saw it."""

    index: int
    dir: str
    """``launch<index>/`` under the run directory: layout, metrics, log, events."""
    alive: list[int]
    """Physical slots alive when the launch was planned."""
    slots: list[int]
    """Physical slots the layout uses, in torchrun rank order."""
    layout: dict[str, Any]
    """The planner's layout (ranks are physical slots)."""
    describe: str
    predicted_step_s: float
    probe_s: float
    """Finding the survivors before this launch (0 for the first)."""
    plan_s: float
    launched_at: float
    resumed_from: int | None = None
    """Committed step loaded at start (None: trained from scratch)."""
    outcome: str = "running"
    """``finished``, ``exit`` (a rank exited non-zero), ``hang`` (heartbeats stopped) or
    ``stopped`` (a stop signal reached the supervisor)."""
    stopped_by: int | None = None
    """The stop signal (SIGINT, SIGTERM) forwarded to the launch, if one was."""
    exit_code: int | None = None
    silent_slots: list[int] = field(default_factory=list)
    hang_timeout: str | None = None
    """For a hang: the timeout the first silent slot exceeded, and how it was set
    (``elastic.heartbeat.Timeout.rule``)."""
    died_slots: list[int] = field(default_factory=list)
    """Slots whose rank process was seen gone before torchrun exited."""
    detected_at: float | None = None
    stop_s: float | None = None
    ended_at: float | None = None

    def events(self, name: str, epoch: int | None = None) -> list[dict[str, Any]]:
        """The launch's events named ``name``; with ``epoch``, those of its ranks'
        ``epoch``-th layout (0: the launch's own, then one per recovery in place)."""
        events = read_events(Path(self.dir) / EVENTS_FILE, name)
        return events if epoch is None else [e for e in events if e.get("epoch", 0) == epoch]

    def failures(self) -> list[dict[str, Any]]:
        """Failures injected during this launch, earliest first."""
        return sorted(self.events("failure"), key=lambda e: e["time"])

    def epochs(self) -> int:
        """Layouts the launch ran: 1 + its recoveries in place that restored a state (a
        failed one ends the launch instead)."""
        restored = {e["epoch"] for e in self.events("restored")}
        return 1 + len(restored)

    def current_slots(self) -> list[int]:
        """The slots of the launch's latest layout (it changes at a recovery in place)."""
        plans = [p for p in self.events("inplace_plan") if p["layout"] is not None]
        return list(plans[-1]["slots"][:_layout_size(plans[-1]["layout"])]) if plans \
            else list(self.slots)


def _layout_size(layout: dict) -> int:
    return sum(len(stage["ranks"]) for pipe in layout["pipelines"] for stage in pipe["stages"])


@dataclass(frozen=True)
class Recovery:
    """The recovery from one failed launch to the first step of the next."""

    failure: str
    """What failed, e.g. ``kill of slot 3 at step 12``."""
    detected_by: str
    slots_before: int
    slots_after: int | None
    layout_after: str | None
    failed_at_step: int | None
    resumed_from: int | None
    steps_redone: int | None
    """Steps done before the failure that ran again after it (since the last commit)."""
    detect_s: float | None
    stop_s: float | None
    probe_s: float | None
    plan_s: float | None
    relaunch_s: float | None
    """From starting torchrun to every rank ready to load: processes, imports,
    process groups, model build."""
    load_s: float | None
    first_step_s: float | None
    total_s: float | None
    """From the failure (or its detection, if not injected) to the first new step."""
    how: str = "relaunch"
    """``relaunch`` or ``in place``."""
    agree_s: float | None = None
    """In place: from the first survivor's error to the decision (planning included)."""
    regroup_s: float | None = None
    """In place: from the decision to the slowest rank's new world and stage."""


def _describe_detection(launch: LaunchRecord) -> str:
    if launch.outcome == "hang":
        return f"heartbeat silent (slots {launch.silent_slots}) past {launch.hang_timeout}"
    if launch.died_slots:
        return f"rank process gone (slots {launch.died_slots})"
    return f"exit code {launch.exit_code}"


def in_place(launch: LaunchRecord, epoch: int) -> Recovery:
    """The recovery in place that began ``launch``'s ``epoch``-th layout."""
    plan = launch.events("inplace_plan", epoch)[0]
    injected = [e for e in launch.failures() if e.get("epoch", 0) == epoch - 1]
    first = injected[0] if injected else None
    caught = min(e["caught"] for e in launch.events("regroup", epoch))
    start = first["time"] if first else caught
    killed = [e for e in launch.events("hang_killed") if start <= e["time"] <= caught]
    detected_by = (f"heartbeat silent {killed[0]['silent_s']:.1f}s past "
                   f"{killed[0]['timeout']} (slot {killed[0]['slot']} killed)" if killed else
                   "collectives with the lost ranks failed")
    restored = launch.events("restored", epoch)
    ready = launch.events("ready", epoch)
    stepped = launch.events("first_step", epoch)
    active = _layout_size(plan["layout"])
    regroup_s = load_s = first_step_s = total_s = resumed = None
    if restored and len(ready) == active:
        built = max(e["time"] - e["restore_s"] for e in restored)
        regroup_s = built - plan["time"]
        load_s = max(e["restore_s"] for e in restored)
        resumed = restored[0]["step"]
        if len(stepped) == active:
            stepped_at = max(e["time"] for e in stepped)
            first_step_s = stepped_at - max(e["time"] for e in ready)
            total_s = stepped_at - start
    previous = launch.events("inplace_plan", epoch - 1)
    before = _layout_size(previous[0]["layout"]) if previous else len(launch.slots)
    what = (", ".join(f"{e['kind']} of slot {e['slot']} at step {e['step']}" for e in injected)
            or f"slots {plan['lost']} lost")
    return Recovery(
        failure=what, detected_by=detected_by, slots_before=before, slots_after=active,
        layout_after=plan["describe"], failed_at_step=plan["failed_step"],
        resumed_from=resumed,
        steps_redone=plan["failed_step"] - 1 - resumed if resumed is not None else None,
        detect_s=caught - start if first else None, stop_s=None, probe_s=None,
        plan_s=plan["plan_s"], relaunch_s=None, load_s=load_s, first_step_s=first_step_s,
        total_s=total_s, how="in place", agree_s=plan["time"] - caught, regroup_s=regroup_s)


def recovery(failed: LaunchRecord, after: LaunchRecord | None) -> Recovery:
    """The recovery from ``failed``; ``after`` is the next launch (None if given up)."""
    last = failed.epochs() - 1  # failures recovered from in place came before its layout
    injected = [e for e in failed.failures() if e.get("epoch", 0) >= last]
    first = injected[0] if injected else None
    unreadable = failed.events("load_failed")
    what = (", ".join(f"{e['kind']} of slot {e['slot']} at step {e['step']}"
                      for e in injected)
            or (f"load of step {failed.resumed_from} failed" if unreadable else "")
            or f"unplanned failure ({failed.outcome})")
    start = first["time"] if first else failed.detected_at
    detect_s = failed.detected_at - start if first and failed.detected_at else None
    relaunch_s = load_s = first_step_s = total_s = None
    if after is not None:
        ready = after.events("ready", 0)
        stepped = after.events("first_step", 0)
        if ready and len(ready) == len(after.slots):
            load_s = max(e["load_s"] for e in ready)
            relaunch_s = max(e["time"] - e["load_s"] for e in ready) - after.launched_at
            ready_at = max(e["time"] for e in ready)
            if stepped and len(stepped) == len(after.slots):
                stepped_at = max(e["time"] for e in stepped)
                first_step_s = stepped_at - ready_at
                total_s = stepped_at - start if start else None
    failed_step = first["step"] if first else None
    resumed = after.resumed_from if after else None
    redone = None
    if failed_step is not None and after is not None:
        redone = failed_step - 1 - (resumed or 0)
    detected_by = _describe_detection(failed)
    if len(failed.events("inplace_plan")) >= failed.epochs():
        detected_by += "; the recovery in place failed"
    return Recovery(
        failure=what, detected_by=detected_by,
        slots_before=len(failed.slots), slots_after=len(after.slots) if after else None,
        layout_after=after.describe if after else None, failed_at_step=failed_step,
        resumed_from=resumed, steps_redone=redone, detect_s=detect_s, stop_s=failed.stop_s,
        probe_s=after.probe_s if after else None, plan_s=after.plan_s if after else None,
        relaunch_s=relaunch_s, load_s=load_s, first_step_s=first_step_s, total_s=total_s)


def recoveries(launches: Sequence[LaunchRecord]) -> list[Recovery]:
    """One recovery per failure, in order: those in place inside a launch, then the
    relaunch after a failed one."""
    out = []
    for i, launch in enumerate(launches):
        out += [in_place(launch, epoch) for epoch in range(1, launch.epochs())]
        if launch.outcome in ("exit", "hang"):
            out.append(recovery(launch, launches[i + 1] if i + 1 < len(launches) else None))
    return out


def write_json(path: str | os.PathLike, launches: Sequence[LaunchRecord],
               extra: dict[str, Any] | None = None) -> None:
    data = {"launches": [asdict(l) for l in launches],
            "recoveries": [asdict(r) for r in recoveries(launches)], **(extra or {})}
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def table(items: Sequence[Recovery]) -> str:
    """Markdown tables, one row per failure, one column per phase (seconds): the
    recoveries in place, then the relaunches."""
    tables = []
    for how, phases, names in (
            ("in place", IN_PLACE_PHASES,
             ["detect", "agree (plan)", "regroup", "restore", "first step"]),
            ("relaunch", PHASES,
             ["detect", "stop", "probe", "plan", "relaunch", "load", "first step"])):
        rows = []
        for r in items:
            if r.how != how:
                continue
            slots = f"{r.slots_before} -> {r.slots_after if r.slots_after is not None else '-'}"
            cells = [r.failure, slots, _fmt(r.resumed_from), _fmt(r.steps_redone)]
            cells += [secs(getattr(r, p)) for p in phases] + [secs(r.total_s)]
            if how == "in place":
                cells[5] += f" ({secs(r.plan_s)})"
            rows.append(cells)
        if rows:
            tables.append(markdown_table(
                [f"failure ({how})", "slots", "resumed from", "redone", *names, "total"], rows))
    return "\n\n".join(tables)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns padded to their widest cell."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |"
              for row in rows]
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    return "-" if value is None else str(value)


def secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"
