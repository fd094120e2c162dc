"""What happened when: one record per launch, and per failure the phases of recovery.

The supervisor times what it does (detect, stop, probe, plan, relaunch); ranks time
what only they see (the checkpoint load, the first step after it, the failure itself)
in the launch's event log. ``recoveries`` joins the two on wall-clock time (one
machine, one clock). The phases of a recovery add up to its total:

    failure -> detect -> stop -> probe -> plan -> relaunch -> load -> first step
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from elastor_mcore.elastic.protocol import EVENTS_FILE, read_events

PHASES = ("detect_s", "stop_s", "probe_s", "plan_s", "relaunch_s", "load_s", "first_step_s")


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
    died_slots: list[int] = field(default_factory=list)
    """Slots whose rank process was seen gone before torchrun exited."""
    detected_at: float | None = None
    stop_s: float | None = None
    ended_at: float | None = None

    def events(self, name: str) -> list[dict[str, Any]]:
        return read_events(Path(self.dir) / EVENTS_FILE, name)

    def failures(self) -> list[dict[str, Any]]:
        """Failures injected during this launch, earliest first."""
        return sorted(self.events("failure"), key=lambda e: e["time"])


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


def _describe_detection(launch: LaunchRecord) -> str:
    if launch.outcome == "hang":
        return f"heartbeat silent (slots {launch.silent_slots})"
    if launch.died_slots:
        return f"rank process gone (slots {launch.died_slots})"
    return f"exit code {launch.exit_code}"


def recovery(failed: LaunchRecord, after: LaunchRecord | None) -> Recovery:
    """The recovery from ``failed``; ``after`` is the next launch (None if given up)."""
    injected = failed.failures()
    first = injected[0] if injected else None
    what = (", ".join(f"{e['kind']} of slot {e['slot']} at step {e['step']}"
                      for e in injected) or f"unplanned failure ({failed.outcome})")
    start = first["time"] if first else failed.detected_at
    detect_s = failed.detected_at - start if first and failed.detected_at else None
    relaunch_s = load_s = first_step_s = total_s = None
    if after is not None:
        ready = after.events("ready")
        stepped = after.events("first_step")
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
    return Recovery(
        failure=what, detected_by=_describe_detection(failed),
        slots_before=len(failed.slots), slots_after=len(after.slots) if after else None,
        layout_after=after.describe if after else None, failed_at_step=failed_step,
        resumed_from=resumed, steps_redone=redone, detect_s=detect_s, stop_s=failed.stop_s,
        probe_s=after.probe_s if after else None, plan_s=after.plan_s if after else None,
        relaunch_s=relaunch_s, load_s=load_s, first_step_s=first_step_s, total_s=total_s)


def recoveries(launches: Sequence[LaunchRecord]) -> list[Recovery]:
    """One recovery per failed launch, in order."""
    out = []
    for i, launch in enumerate(launches):
        if launch.outcome in ("exit", "hang"):
            out.append(recovery(launch, launches[i + 1] if i + 1 < len(launches) else None))
    return out


def write_json(path: str | os.PathLike, launches: Sequence[LaunchRecord],
               extra: dict[str, Any] | None = None) -> None:
    data = {"launches": [asdict(l) for l in launches],
            "recoveries": [asdict(r) for r in recoveries(launches)], **(extra or {})}
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def table(items: Sequence[Recovery]) -> str:
    """A Markdown table: one row per failure, one column per phase (seconds)."""
    header = ["failure", "slots", "resumed from", "redone", "detect", "stop", "probe",
              "plan", "relaunch", "load", "first step", "total"]
    rows = []
    for r in items:
        slots = f"{r.slots_before} -> {r.slots_after if r.slots_after is not None else '-'}"
        cells = [r.failure, slots, _fmt(r.resumed_from), _fmt(r.steps_redone)]
        cells += [secs(getattr(r, p)) for p in PHASES] + [secs(r.total_s)]
        rows.append(cells)
    return markdown_table(header, rows)


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
