"""What a training rank does for the supervisor: heartbeats, events, injected failures.

This is the rank side of the supervisor's file protocol (the supervisor in
``elastic/`` reads what is written here): the per-launch event log, one heartbeat
file per slot, and the failure plan's injection. Standard library only, so the
supervisor can import the names without torch.

``elastor launch`` passes the worker three flags (``worker_args``); the worker turns
them into an :class:`ElasticHooks` (``from_args``) that ``train`` calls on every
active rank. Torchrun ranks are contiguous (0..n-1) while the survivors' slots are
not, so ``--slots`` maps each rank to its physical slot.
"""

from __future__ import annotations

import argparse
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

HEARTBEAT_DIR = "heartbeat"
"""The heartbeat files' folder inside a launch directory."""


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




def add_worker_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--elastic-dir", default=None,
                        help="set by elastor launch: heartbeats and events of this launch")
    parser.add_argument("--slots", default=None,
                        help="physical slot of each rank, comma-separated, in rank order")
    parser.add_argument("--failure-plan", default=None, help="failure plan YAML to inject")


def worker_args(elastic_dir: str | os.PathLike, slots: Sequence[int],
                failure_plan: str | os.PathLike | None) -> list[str]:
    """The flags ``add_worker_args`` reads, for a launch on ``slots`` (rank order)."""
    args = ["--elastic-dir", str(elastic_dir), "--slots", ",".join(map(str, slots))]
    if failure_plan:
        args += ["--failure-plan", str(failure_plan)]
    return args


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


def from_args(args: argparse.Namespace, rank: int) -> RankHooks:
    """The hooks for this rank: elastic ones under ``elastor launch``, else no-ops."""
    if not args.elastic_dir:
        return RankHooks()
    slots = [int(s) for s in args.slots.split(",")] if args.slots else None
    slot = slots[rank] if slots else rank
    failures = load_failure_plan(args.failure_plan) if args.failure_plan else ()
    return ElasticHooks(args.elastic_dir, rank, slot, failures)
