"""What a training rank does for the supervisor: heartbeats, events, injected failures.

This is the rank side of the supervisor's file protocol (the supervisor in
``elastic/`` reads what is written here): the per-launch event log, one heartbeat
file per slot, and the failure plan's injection. Standard library only, so the
supervisor can import the names without torch.

``elastor launch`` sets three run settings of the worker (``elastic_dir``,
``rank_slots``, ``failure_plan``); the worker turns them into an
:class:`ElasticHooks` (``from_settings``) that ``train`` calls on every active rank.
Torchrun ranks are contiguous (0..n-1) while the survivors' slots are not, so
``rank_slots`` maps each rank to its physical slot.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from elastor_mcore.config.failure_plan import Failure, load_failure_plan
from elastor_mcore.config.run import RunSettings

log = logging.getLogger(__name__)

EVENTS_FILE = "events.jsonl"
"""The event log's name inside a launch directory."""


def append_event(path: str | os.PathLike, event: str, **fields: Any) -> None:
    record = {"event": event, "time": time.time(), **fields}
    line = (json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)

def read_events(path: str | os.PathLike, event: str | None = None) -> list[dict[str, Any]]:
    """Every complete event in the file (optionally only those named ``event``)."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by a SIGKILL mid-write
        if event is None or record.get("event") == event:
            records.append(record)
    return records


HEARTBEAT_DIR = "heartbeat"
"""The heartbeat files' folder inside a launch directory."""

# A node directory of a multi-node job (``elastic.node``, ``runtime.node_worker``):
LAUNCHER_EVENTS = "launcher.jsonl"
"""The node launcher's event log (the agent's lines, hang kills)."""
ROUNDS_FILE = "rounds.jsonl"
"""One record per rendezvous round the node took part in (members, plan)."""
ROUNDS_DIR = "rounds"
"""``rounds/<R>/``: a round's layout, rank events, heartbeats and metrics."""
OUTCOME_FILE = "outcome.json"
"""How the job ended, written by the node's local rank 0 for its launcher."""


@dataclass(frozen=True)
class Beat:
    slot: int
    rank: int
    pid: int
    """The rank's process; also its process group (torchrun starts each worker in a
    new session), so the supervisor can stop the rank's children too."""
    step: int
    """Steps done (1-based number of the last finished step; the resumed step at setup)."""
    stepping: bool
    """Whether the rank has finished a step since it started (short timeout applies)."""
    time: float
    """Wall-clock time of the beat (``time.time()``)."""


class HeartbeatWriter:
    """The rank side: one file, replaced atomically at each beat."""

    def __init__(self, directory: str | os.PathLike, slot: int, rank: int) -> None:
        self.path = Path(directory) / f"slot{slot}"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.slot, self.rank = slot, rank

    def beat(self, step: int, stepping: bool) -> None:
        beat = Beat(self.slot, self.rank, os.getpid(), step, stepping, time.time())
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(beat.__dict__))
        os.replace(tmp, self.path)


def inject(failure: Failure) -> None:
    """Fail this process now, as ``failure.kind`` says; never returns."""
    log.warning("injecting %s of slot %d at step %d", failure.kind, failure.slot,
                failure.step)
    if failure.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    while True:  # a hung collective: alive, silent, never finishing the step
        threading.Event().wait(3600)


class RankHooks:
    """Called on every active rank (``on_step`` runs on the reporting rank only): the
    elastic supervisor's heartbeats and injected failures (``ElasticHooks`` below).
    Steps are 1-based, as printed. The base class does nothing."""

    def ready(self, start_step: int, load_s: float) -> None:
        """Set up and, after ``load_s`` seconds of loading, resumed at ``start_step``."""

    def step_start(self, step: int) -> None:
        """Step ``step`` is about to begin."""

    def step_end(self, step: int) -> None:
        """Step ``step`` is done (and its save, if one was due, started)."""


class ElasticHooks(RankHooks):
    """Heartbeat after setup and every step; record the load, the first step and any
    injected failure; fail as the failure plan says when this slot reaches its step."""

    def __init__(self, elastic_dir: str | os.PathLike, rank: int, slot: int,
                 failures: Sequence[Failure] = ()) -> None:
        self.rank, self.slot = rank, slot
        self.events = Path(elastic_dir) / EVENTS_FILE
        self.heartbeat = HeartbeatWriter(Path(elastic_dir) / HEARTBEAT_DIR, slot, rank)
        self.failures = {f.step: f for f in failures if f.slot == slot}
        self.stepped = False
        self.heartbeat.beat(0, stepping=False)  # the supervisor learns our pid early

    def ready(self, start_step: int, load_s: float) -> None:
        append_event(self.events, "ready", rank=self.rank, slot=self.slot,
                     start_step=start_step, load_s=load_s)
        self.heartbeat.beat(start_step, stepping=False)

    def step_start(self, step: int) -> None:
        failure = self.failures.get(step)
        if failure:
            append_event(self.events, "failure", rank=self.rank, slot=self.slot, step=step,
                         kind=failure.kind)
            inject(failure)

    def step_end(self, step: int) -> None:
        if not self.stepped:
            append_event(self.events, "first_step", rank=self.rank, slot=self.slot, step=step)
            self.stepped = True
        self.heartbeat.beat(step, stepping=True)


def from_settings(settings: RunSettings, rank: int) -> RankHooks:
    """The hooks for this rank: elastic ones under ``elastor launch``, else no-ops."""
    if not settings.elastic_dir:
        return RankHooks()
    slot = settings.rank_slots[rank] if settings.rank_slots else rank
    failures = load_failure_plan(settings.failure_plan) if settings.failure_plan else ()
    return ElasticHooks(settings.elastic_dir, rank, slot, failures)
