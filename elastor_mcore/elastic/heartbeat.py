"""Heartbeats: each rank rewrites ``<dir>/slot<N>`` after setup and after every step;
the supervisor declares a hang when a rank's file stops advancing.

A hung collective leaves every process alive, so exit codes cannot reveal it; a
file per rank costs one small atomic write per step and needs no extra process or
connection. Timeouts are generous until a rank has finished its first step of a
launch (imports, model build and checkpoint load take tens of seconds on a loaded
machine) and short afterwards.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

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


def read_beats(directory: str | os.PathLike) -> dict[int, Beat]:
    """The latest beat of every slot that has beaten, by slot."""
    beats = {}
    for path in Path(directory).glob("slot*"):
        if path.suffix == ".tmp":
            continue
        try:
            beat = Beat(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue  # replaced while we read it: the next poll sees the new one
        beats[beat.slot] = beat
    return beats


@dataclass(frozen=True)
class HangPolicy:
    startup_timeout_s: float = 300.0
    """Silence allowed before a rank's first step of a launch (imports, build, load)."""
    timeout_s: float = 60.0
    """Silence allowed between two beats once the rank is stepping."""

    def silent_slots(self, slots: list[int], beats: dict[int, Beat], launched_at: float,
                     now: float, last_step: int) -> list[int]:
        """Slots whose rank has been silent longer than its phase allows. A rank past
        ``last_step`` only finishes its last save and exits: the generous limit applies."""
        silent = []
        for slot in slots:
            beat = beats.get(slot)
            if beat is None or not beat.stepping or beat.step >= last_step:
                if now - (beat.time if beat else launched_at) > self.startup_timeout_s:
                    silent.append(slot)
            elif now - beat.time > self.timeout_s:
                silent.append(slot)
        return silent
